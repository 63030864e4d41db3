"""The memory broker's sampling against engine state that changes while a sample is taken.

A GPU sample runs in a worker thread; meanwhile the engine's owner may start a wake (claiming
its awake size back), finish a sleep, or see its process exit. What the sample measured may be
from either side of that change, so it must never be taken as the engine's footprint.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from runtime_agent.gpu.admission import Refuse
from runtime_agent.gpu.broker import EngineRef, MemoryBroker
from runtime_agent.gpu.model import Device, GpuProcess, GpuSample

pytestmark = pytest.mark.loop_guard  # the in-process core must not block its loop

GiB = 1 << 30
PID = os.getpid()  # attribution needs a live process tree: this test's own process


class OneCard:
    """An 80 GiB card whose one process (this one) holds ``used``; ``hold`` stalls a sample."""

    name = "fake"

    def __init__(self) -> None:
        self.used = 1 * GiB
        self.hold: threading.Event | None = None

    def sample(self) -> GpuSample:
        if self.hold is not None:
            self.hold.wait(10)
        free = 80 * GiB - self.used
        return GpuSample((Device(0, "GPU-0", "fake", 80 * GiB, free, self.used, None),),
                         (GpuProcess(PID, 0, self.used),), time.time(), True)

    def close(self) -> None:
        pass


class Engine:
    """The owner's side, as the broker sees it through ``EngineRef``."""

    def __init__(self) -> None:
        self.phase, self.op, self.since = "active", None, 0.0

    def move(self, phase: str | None = None, op: str | None = None) -> None:
        self.phase, self.op = phase or self.phase, op
        self.since += 1.0

    def refs(self) -> dict[str, EngineRef]:
        sleeping = self.phase == "sleeping" or self.op == "sleep"
        return {"m": EngineRef(PID, (0,), sleeping, self.op is None, self.since)}


async def asleep_after_40_gib(card: OneCard, engine: Engine) -> MemoryBroker:
    broker = MemoryBroker(card, engine.refs)
    await broker.sample_now()
    broker.adopt("m", (0,), 40 * GiB, sleeping=False)
    card.used = 40 * GiB
    await broker.sample_now()  # measured awake: 40 GiB
    engine.move(op="sleep")
    broker.set_sleeping("m", True)
    card.used = 1 * GiB
    engine.move("sleeping")
    await broker.sample_now()  # measured asleep: 1 GiB
    return broker


async def test_a_wake_that_begins_during_a_sample_keeps_its_claim() -> None:
    card, engine = OneCard(), Engine()
    broker = await asleep_after_40_gib(card, engine)
    assert broker.ledger.charge("m", 0) == 1 * GiB
    card.hold = threading.Event()
    sampling = asyncio.create_task(broker.sample_now())  # sees the engine asleep and steady
    await asyncio.sleep(0.05)
    assert broker.claim_wake("m") is not None  # the owner starts a wake meanwhile
    engine.move(op="wake")
    card.hold.set()
    await sampling
    assert broker.ledger.charge("m", 0) == 40 * GiB, "the wake's claim survives the sample"
    assert isinstance(broker.claim_start("other", 45 * GiB, 1), Refuse)
    assert broker.figures["m"].sleeping_footprint_bytes == 1 * GiB


async def test_a_sleep_that_ends_during_a_sample_is_not_measured_from_it() -> None:
    card, engine = OneCard(), Engine()
    broker = MemoryBroker(card, engine.refs)
    await broker.sample_now()
    broker.adopt("m", (0,), 40 * GiB, sleeping=False)
    card.used = 40 * GiB
    await broker.sample_now()
    engine.move(op="sleep")
    broker.set_sleeping("m", True)
    card.hold = threading.Event()
    sampling = asyncio.create_task(broker.sample_now())  # the engine's memory still 40 GiB
    await asyncio.sleep(0.05)
    engine.move("sleeping")  # the sleep call returns: steady, asleep
    card.hold.set()
    await sampling
    assert broker.figures["m"].sleeping_footprint_bytes is None, "40 GiB is not its sleep size"
    card.used = 1 * GiB
    await broker.sample_now()
    assert broker.figures["m"].sleeping_footprint_bytes == 1 * GiB


async def test_a_new_sleep_forgets_the_last_sleeps_footprint_until_measured() -> None:
    card, engine = OneCard(), Engine()
    broker = await asleep_after_40_gib(card, engine)
    assert broker.figures["m"].sleeping_footprint_bytes == 1 * GiB
    broker.claim_wake("m")
    engine.move(op="wake")
    card.used = 40 * GiB
    broker.set_sleeping("m", False)
    engine.move("active")
    await broker.sample_now()
    engine.move(op="sleep")
    broker.set_sleeping("m", True)  # this sleep may hold more (or less) than the last
    assert broker.figures["m"].sleeping_footprint_bytes is None
    card.used = 6 * GiB
    engine.move("sleeping")
    await broker.sample_now()
    assert broker.figures["m"].sleeping_footprint_bytes == 6 * GiB


async def test_a_wake_shares_its_cards_turn_only_when_its_size_is_known() -> None:
    card, engine = OneCard(), Engine()
    broker = await asleep_after_40_gib(card, engine)  # measured awake: 40 GiB
    assert broker.wake_is_sized("m")
    broker.adopt("declared", (0,), 2 * GiB, sleeping=True)  # never measured, but declared
    assert broker.wake_is_sized("declared")
    broker.adopt("unknown", (0,), 0, sleeping=True)  # nothing declared, never measured awake
    assert not broker.wake_is_sized("unknown")
    assert not broker.wake_is_sized("absent")  # not in the ledger at all


def test_samples_that_differ_only_in_their_time_are_no_change_and_sampling_backs_off() -> None:
    from runtime_agent.gpu.broker import _same_memory

    card = OneCard()
    first, again = card.sample(), card.sample()
    assert _same_memory(first, again)  # steady: the sampler's interval grows
    card.used = 2 * GiB
    assert not _same_memory(first, card.sample())  # memory moved: back to the interval
    assert not _same_memory(None, first)  # nothing to compare with: a change


async def test_a_steady_card_is_sampled_less_often_and_a_poke_samples_at_once() -> None:
    engine = Engine()
    broker = MemoryBroker(OneCard(), engine.refs, interval_s=0.01, steady_cap_s=60.0)
    await broker.start()
    try:
        async with asyncio.timeout(10):
            while broker.samples_total < 8:  # 0.01 + 0.02 + ... + 0.64 s: the interval grows
                await asyncio.sleep(0.05)
        steady = broker.samples_total
        await asyncio.sleep(0.5)  # at 1.28 s and growing, no sample comes in this half second
        assert broker.samples_total <= steady + 1
        broker.poke()
        async with asyncio.timeout(10):
            while broker.samples_total <= steady + 1:  # the poke samples at once
                await asyncio.sleep(0.01)
    finally:
        await broker.close()
