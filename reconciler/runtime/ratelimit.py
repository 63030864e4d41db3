"""Per-key exponential failure backoff: how long a failing key waits before its next try.

controller-runtime's default item limiter: the n-th consecutive failure of a key waits
``base * 2**(n-1)`` (5 ms, 10 ms, 20 ms, ...) up to ``cap`` (1000 s); a success forgets the
key's failures so its next failure starts again at ``base``. Keys back off independently, so
one broken model never slows the others. No clock and no I/O: the work queue turns the delay
into a delayed add.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

DEFAULT_BASE_DELAY = 0.005
DEFAULT_MAX_DELAY = 1000.0


def backoff_delay(failures: int, base: float = DEFAULT_BASE_DELAY,
                  cap: float = DEFAULT_MAX_DELAY) -> float:
    """The delay after ``failures`` earlier failures: ``min(cap, base * 2**failures)``."""
    if failures < 0:
        raise ValueError("failures must not be negative")
    try:
        return min(cap, base * 2.0 ** failures)
    except OverflowError:  # 2.0 ** n overflows past n = 1023; the cap was reached long before
        return cap


class RateLimiter(Protocol):
    """What the work queue needs from a limiter (``ExponentialBackoff`` is the default)."""

    def when(self, key: Hashable) -> float: ...

    def forget(self, key: Hashable) -> None: ...

    def failures(self, key: Hashable) -> int: ...


class ExponentialBackoff:
    """Failure counts per key, and the delay each new failure earns."""

    def __init__(self, base: float = DEFAULT_BASE_DELAY, cap: float = DEFAULT_MAX_DELAY) -> None:
        if base <= 0 or cap < base:
            raise ValueError("need base > 0 and cap >= base")
        self.base = base
        self.cap = cap
        self._failures: dict[Hashable, int] = {}

    def when(self, key: Hashable) -> float:
        """Count one more failure of ``key`` and return how long it waits before its retry."""
        done = self._failures.get(key, 0)
        self._failures[key] = done + 1
        return backoff_delay(done, self.base, self.cap)

    def forget(self, key: Hashable) -> None:
        """Clear ``key``'s failures (after a success): its next failure waits ``base`` again."""
        self._failures.pop(key, None)

    def failures(self, key: Hashable) -> int:
        """Consecutive failures of ``key`` since it was last forgotten."""
        return self._failures.get(key, 0)
