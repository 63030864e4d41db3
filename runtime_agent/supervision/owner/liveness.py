"""Whether a ready engine still answers: a pure verdict from its health probes' results.

Misses in a row make the engine unresponsive (not ready, the ``EngineUnresponsive`` condition)
after ``unresponsive_after``; once unresponsive for ``unresponsive_grace_s`` it is to be killed
and restarted as a crash. A stopped (SIGSTOP) or deadlocked engine is caught this way; a
booting one is the start-stall watch's business. The loop carries the verdict out.
"""

from __future__ import annotations

from msgspec import Struct



class Verdict(Struct, frozen=True):
    event: str | None = None  # became unresponsive: the event's message
    kill: str | None = None  # unresponsive too long: why it is killed


class Liveness:
    def __init__(self, after: int, grace_s: float) -> None:
        self._after, self._grace_s = after, grace_s
        self._since: float | None = None  # health probes unanswered since

    @property
    def unresponsive(self) -> bool:
        return self._since is not None

    def reset(self) -> None:
        """A new process, or none: nothing is known of its answers yet."""
        self._since = None

    def answered(self) -> bool:
        """A probe was answered; True when the engine had been unresponsive until now."""
        was, self._since = self._since is not None, None
        return was

    def missed(self, misses: int, now: float) -> Verdict:
        if misses < self._after:
            return Verdict()
        if self._since is None:
            self._since = now
            return Verdict(event=f"no answer to {misses} health probes in a row; restarted if "
                           f"it does not answer within {self._grace_s:g} s")
        if now - self._since >= self._grace_s:
            return Verdict(kill=f"unresponsive: no answer to its health probe for "
                           f"{now - self._since:.0f} s")
        return Verdict()
