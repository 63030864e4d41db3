"""The clock every timed part of the runtime reads: injectable, so tests never sleep.

The work queue's delayed adds, the controller's durations, the sources' intervals and reconnect
backoff all go through a ``Clock``. Production uses ``RealClock`` (the monotonic clock and
``asyncio.sleep``); tests use ``FakeClock``, whose time moves only when the test calls
``advance``, which wakes every sleeper that has come due, earliest deadline first.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds; only differences mean anything."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock (at once for ``seconds <= 0``)."""
        ...


class RealClock:
    """The event loop's time: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that stands still until ``advance``; sleepers wake in deadline order.

    ``advance`` only resolves the sleepers' futures: the woken tasks run at the event loop's
    next turn, so a test awaits something (the queue, an event, ``asyncio.sleep(0)``) after it.
    A sleep of zero or less still yields once to the loop, like ``asyncio.sleep(0)``.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._seq = itertools.count()
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), future))
        await future  # a cancelled sleeper's future is cancelled too, and skipped by advance

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` and wake every sleeper now due."""
        if seconds < 0:
            raise ValueError("a clock never goes back")
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)

    def next_deadline(self) -> float | None:
        """When the earliest pending sleeper wakes, or None when nobody sleeps."""
        self._drop_cancelled()
        return self._sleepers[0][0] if self._sleepers else None

    @property
    def sleepers(self) -> int:
        """How many tasks sleep on this clock now."""
        self._drop_cancelled()
        return sum(1 for _, _, future in self._sleepers if not future.done())

    def _drop_cancelled(self) -> None:
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)
