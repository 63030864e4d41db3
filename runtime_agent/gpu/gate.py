"""One engine at a time starts or wakes on a card; the others wait their turn, in order.

vLLM measures free GPU memory while it starts (memory profiling) and sizes its KV cache from it;
if another engine allocates on the same card at that moment, both measure wrong and one runs out
of memory. So starts and wakes take a *turn* on every card they use.

A turn takes all its cards at once or waits; it never holds some cards while waiting for others,
so turns on overlapping card sets cannot deadlock (the same guarantee as taking cards in a global
order, without holding a card idle). Fairness is FIFO among turns that share a card: a turn is
granted only when its cards are free and no earlier waiting turn wants any of them; turns on
disjoint cards do not wait for each other. Not re-entrant: a task must not nest turns on a shared
card. Cancelling a waiting turn withdraws it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass


@dataclass
class _Waiter:
    devices: frozenset[int]
    future: asyncio.Future[None]


class DeviceGate:
    def __init__(self) -> None:
        self._busy: set[int] = set()
        self._queue: list[_Waiter] = []

    @asynccontextmanager
    async def turn(self, devices: Iterable[int]) -> AsyncIterator[None]:
        """Hold the turn on ``devices`` for the body of the ``async with``."""
        wanted = frozenset(devices)
        if not wanted:
            yield
            return
        await self._acquire(wanted)
        try:
            yield
        finally:
            self._release(wanted)

    async def _acquire(self, wanted: frozenset[int]) -> None:
        waiter = _Waiter(wanted, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._grant()  # free cards and nobody earlier wanting them: granted at once
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self._release(wanted)  # granted just as we were cancelled: give it back
            else:
                self._queue.remove(waiter)
                self._grant()  # we may have been holding back later, disjoint turns
            raise

    def _release(self, devices: frozenset[int]) -> None:
        self._busy -= devices
        self._grant()

    def _grant(self) -> None:
        wanted_earlier: set[int] = set()
        for waiter in list(self._queue):
            if not (waiter.devices & (self._busy | wanted_earlier)):
                self._queue.remove(waiter)
                self._busy |= waiter.devices
                waiter.future.set_result(None)
            else:
                wanted_earlier |= waiter.devices

    # ---- for the snapshot (never blocks) --------------------------------------------------

    def waiters(self, device: int | None = None) -> int:
        """Turns waiting (on ``device``, or on any card)."""
        return sum(1 for w in self._queue if device is None or device in w.devices)

    def busy(self) -> frozenset[int]:
        """Cards on which a start or wake holds the turn now."""
        return frozenset(self._busy)
