"""Garbage collection for a process that holds a large, long-lived heap: the reconciler at
fleet size (10,000 claims' statuses, 1,000 agents' snapshots).

CPython's full collection walks every tracked object. At 2,000 claims it paused the event loop
for 0.3-0.5 s every few seconds while converging and every ~15 s at rest, finding no garbage at
all: those pauses were the create -> activate tail (``bench/RESULTS.md`` figure 9). ``gc.freeze``
moves every object alive now into a permanent generation that collections skip, so a collection
walks only what is newer than the last freeze.

``HeapFreezer.tick`` (every ``every`` seconds): collect the young generations (cheap; so young
cyclic garbage is not frozen), then freeze. Every ``full_every`` seconds instead: unfreeze,
collect everything (the one full pause, once an hour: cycles that formed among frozen objects
are freed then), and freeze again. Objects freed by reference counting are freed at once,
frozen or not; only cyclic garbage waits for the hourly collection.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from contract.clock import LoopClock

log = logging.getLogger("reconciler.heap")

FREEZE_EVERY_S = 10.0
FULL_EVERY_S = 3600.0


class GcApi(Protocol):
    def collect(self, generation: int = 2) -> int: ...
    def freeze(self) -> None: ...
    def unfreeze(self) -> None: ...
    def get_freeze_count(self) -> int: ...


class HeapFreezer:
    def __init__(self, gc_api: GcApi = gc, *, every: float = FREEZE_EVERY_S,
                 full_every: float = FULL_EVERY_S,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], Awaitable[object]] | None = None) -> None:
        if every <= 0 or full_every < every:
            raise ValueError("need 0 < every <= full_every")
        real = LoopClock()  # the time and the wait, unless a test gives its own
        self._gc, self.every, self.full_every = gc_api, every, full_every
        self._clock, self._sleep = clock or real.now, sleep or real.sleep
        self._last_full = self._clock()

    def tick(self) -> str:
        """One step: "freeze", or "full" when a full collection was due. Synchronous."""
        now = self._clock()
        if now - self._last_full >= self.full_every:
            started = time.perf_counter()
            self._gc.unfreeze()
            found = self._gc.collect()
            self._gc.freeze()
            self._last_full = now
            log.info("full collection: %d unreachable objects, %.0f ms, %d frozen", found,
                     (time.perf_counter() - started) * 1000, self._gc.get_freeze_count())
            return "full"
        self._gc.collect(1)
        self._gc.freeze()
        return "freeze"

    async def run(self) -> None:
        """Tick every ``every`` seconds until cancelled (then everything is unfrozen again)."""
        try:
            while True:
                await self._sleep(self.every)
                self.tick()
        finally:
            self._gc.unfreeze()


@contextlib.asynccontextmanager
async def frozen_heap(freezer: HeapFreezer | None = None) -> AsyncIterator[HeapFreezer]:
    """The process's heap frozen every few seconds while the block runs (the reconciler's
    commands wrap their serving in it; an embedded reconciler leaves its host's heap alone)."""
    freezer = freezer or HeapFreezer()
    task = asyncio.get_running_loop().create_task(freezer.run())
    try:
        yield freezer
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
