"""The cache's decisions, as plain functions over plain data: room on disk and who is evicted for
it, and how fast a download goes.

``make_room`` is called with no await between it and the moment its answer is acted on, so two
downloads starting together never count the same free bytes (``committed`` is what downloads
already running will still write).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contract.quantity import gib

RATE_SMOOTHING = 0.3  # weight of the newest sample in the moving average


@dataclass(frozen=True)
class Evictable:
    """A ready entry no engine uses."""

    entry_id: str
    size: int
    last_used_at: float


@dataclass(frozen=True)
class Room:
    ok: bool
    evict: tuple[str, ...] = ()
    message: str = ""


def make_room(need: int, free: int, reserve: int, committed: int,
              candidates: Sequence[Evictable]) -> Room:
    """Whether ``need`` more bytes fit, keeping ``reserve`` free; if only with evictions, the
    least recently used entries first, as few as LRU order allows."""
    short = need + committed + reserve - free
    if short <= 0:
        return Room(True)
    chosen: list[str] = []
    freed = 0
    for c in sorted(candidates, key=lambda c: (c.last_used_at, c.entry_id)):
        if freed >= short:
            break
        chosen.append(c.entry_id)
        freed += c.size
    if freed >= short:
        return Room(True, tuple(chosen), f"evicting {len(chosen)} unused entries "
                    f"({gib(freed)}) to make room")
    return Room(False, message=(
        f"not enough disk space: the download needs {gib(need)} more, the disk has "
        f"{gib(free)} free, {gib(reserve)} is kept in reserve, {gib(committed)} is promised "
        f"to other downloads, and unused entries would free only {gib(freed)}"))


@dataclass(frozen=True)
class Rate:
    """A download's speed: a moving average of bytes per second between samples."""

    at: float
    done: int
    per_s: float | None = None

    def next(self, at: float, done: int) -> Rate:
        dt = at - self.at
        if dt <= 0:
            return self
        sample = max(0.0, (done - self.done) / dt)
        per_s = sample if self.per_s is None else (
            RATE_SMOOTHING * sample + (1 - RATE_SMOOTHING) * self.per_s)
        return Rate(at, done, per_s)


def eta_s(rate: float | None, done: int, total: int) -> float | None:
    """Seconds left at ``rate``; None while the rate is unknown or zero."""
    if total <= done:
        return 0.0
    if not rate:
        return None
    return (total - done) / rate
