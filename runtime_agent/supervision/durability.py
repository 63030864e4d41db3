"""Storage faults never cost control: a record write that fails is retried, never fatal.

A full (ENOSPC), read-only (EROFS) or failing (EIO) state directory must not end an engine's
owner: it keeps supervising its engine, reports the condition (the engine's
``StorageUnavailable``, ``/healthz``'s ``degraded``), and writes again after a growing pause
until a write succeeds. What cannot be made durable is refused instead: the pool and the
owners ask ``StorageHealth`` before a change a restarted agent would have to remember, and
answer 503 saying why; nothing is sent to an engine before its record is written. A stop
is the exception: on a read-only directory it is remembered beside the KV segments
(``registry.stops``) and made, since ending an engine is safe once a restarted agent will
finish the stop instead of starting the engine again.

This module holds what all owners share; each owner's writer is
``runtime_agent.supervision.owner.records``.
"""

from __future__ import annotations


from msgspec import Struct, field

from contract.reasons import STORAGE_UNAVAILABLE
from runtime_agent.supervision.outcomes import Refusal, Refused


class StorageHealth(Struct):
    """The state directory as the owners last found it; one per agent, shared."""

    failing: dict[str, str] = field(default_factory=dict)  # engine id -> the last error

    @property
    def problem(self) -> str | None:
        return next(iter(self.failing.values()), None)

    def refusal(self, model_name: str | None) -> Refused | None:
        """A 503 for a change that could not be remembered now, or None."""
        if self.problem is None:
            return None
        return Refused(Refusal.UNAVAILABLE, f"the agent's state directory cannot be written "
                       f"({self.problem}); it would not remember this change after a restart, "
                       "so it refuses it until the directory is writable again",
                       STORAGE_UNAVAILABLE, model_name)
