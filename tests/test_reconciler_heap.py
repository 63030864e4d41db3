"""The heap freezer: young collections and a freeze on each tick, a full collection hourly."""

from __future__ import annotations

import asyncio
import gc

import pytest

from reconciler.runtime.heap import HeapFreezer, frozen_heap


class FakeGc:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.frozen = 0

    def collect(self, generation: int = 2) -> int:
        self.calls.append(f"collect{generation}")
        return 0

    def freeze(self) -> None:
        self.calls.append("freeze")
        self.frozen += 1

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")

    def get_freeze_count(self) -> int:
        return self.frozen


def test_a_tick_collects_the_young_generations_then_freezes() -> None:
    fake, now = FakeGc(), [0.0]
    freezer = HeapFreezer(fake, every=10, full_every=60, clock=lambda: now[0])
    now[0] = 10
    assert freezer.tick() == "freeze"
    assert fake.calls == ["collect1", "freeze"]


def test_a_full_collection_comes_once_per_full_every() -> None:
    fake, now = FakeGc(), [0.0]
    freezer = HeapFreezer(fake, every=10, full_every=60, clock=lambda: now[0])
    kinds = []
    for t in range(10, 130, 10):
        now[0] = t
        kinds.append(freezer.tick())
    assert kinds == ["freeze"] * 5 + ["full"] + ["freeze"] * 5 + ["full"]
    assert fake.calls[10:13] == ["unfreeze", "collect2", "freeze"]


def test_bad_intervals_are_refused() -> None:
    with pytest.raises(ValueError):
        HeapFreezer(FakeGc(), every=0)
    with pytest.raises(ValueError):
        HeapFreezer(FakeGc(), every=10, full_every=5)


async def test_run_ticks_until_cancelled_and_unfreezes() -> None:
    fake = FakeGc()
    ticks = asyncio.Event()

    async def sleep(seconds: float) -> None:
        if fake.frozen >= 3:
            ticks.set()
            await asyncio.Event().wait()

    async with frozen_heap(HeapFreezer(fake, every=1, full_every=100, clock=lambda: 0.0,
                                       sleep=sleep)):
        await asyncio.wait_for(ticks.wait(), 5)
    assert fake.calls[:6] == ["collect1", "freeze"] * 3 and fake.calls[-1] == "unfreeze"


def test_with_the_real_collector_objects_alive_are_frozen_and_given_back() -> None:
    freezer = HeapFreezer(every=1, full_every=2, clock=lambda: 0.0)
    try:
        assert freezer.tick() == "freeze"
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
