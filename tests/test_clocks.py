"""The tests' one fake clock keeps the contract's promises: timers and sleepers come due together,
in deadline order, by hand or stepped (its sleepers alone: ``test_reconciler_runtime_ratelimit``)."""

from __future__ import annotations

import asyncio

import pytest

from contract.clock import Clock
from tests.clocks import FakeClock

pytestmark = [pytest.mark.timeout(30), pytest.mark.loop_guard]


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_the_fake_is_a_contract_clock_whose_wall_time_follows_its_monotonic_time() -> None:
    clock: Clock = FakeClock(1000.0)
    assert clock.now() == 1000.0 and clock.wall() == 1.8e9 + 1000.0


async def test_timers_and_sleepers_come_due_together_in_deadline_order() -> None:
    clock, fired = FakeClock(), []

    async def sleeper() -> None:
        await clock.sleep(2.0)
        fired.append(("sleeper", clock.now()))

    task = asyncio.create_task(sleeper())
    await settle()
    clock.later(3.0, lambda: fired.append(("late timer", clock.now())))
    clock.later(1.0, lambda: fired.append(("early timer", clock.now())))
    assert clock.next_deadline() == 1.0 and clock.sleepers == 1
    clock.advance(0.5)
    await settle()
    assert fired == []
    clock.advance(4.5)
    assert fired == [("early timer", 1.0), ("late timer", 3.0)]  # each at its own deadline
    await settle()
    assert fired[-1] == ("sleeper", 5.0) and clock.next_deadline() is None
    await task


async def test_a_cancelled_timer_never_fires_and_a_timer_fires_once() -> None:
    clock, fired = FakeClock(), []
    clock.later(1.0, lambda: fired.append("cancelled")).cancel()
    kept = clock.later(1.0, lambda: fired.append("kept"))
    assert clock.next_deadline() == 1.0
    clock.advance(1.0)
    kept.cancel()  # a no-op once it ran
    clock.advance(10.0)
    assert fired == ["kept"] and clock.next_deadline() is None


async def test_a_timer_set_from_a_timer_fires_in_the_same_advance_when_due() -> None:
    clock, fired = FakeClock(), []

    def first() -> None:
        fired.append(clock.now())
        clock.later(1.0, lambda: fired.append(clock.now()))

    clock.later(1.0, first)
    clock.advance(5.0)
    assert fired == [1.0, 2.0] and clock.now() == 5.0


async def test_a_timer_due_at_once_fires_at_the_next_turn_without_an_advance() -> None:
    clock, fired = FakeClock(), asyncio.Event()
    clock.later(0.0, fired.set)
    assert not fired.is_set()
    await asyncio.wait_for(fired.wait(), 5)
    assert clock.now() == 0.0


async def test_a_stepped_clock_moves_to_each_wait_s_end_and_stops_the_loop_at_its_limit() -> None:
    clock, fired = FakeClock(1000.0, stepped=True, limit=3), asyncio.Event()
    await clock.sleep(5.0)
    assert clock.now() == 1005.0
    clock.later(2.0, fired.set)
    await asyncio.wait_for(fired.wait(), 5)
    assert clock.now() == 1007.0
    with pytest.raises(asyncio.CancelledError):
        await clock.sleep(1.0)
    assert clock.asked == [5.0, 2.0, 1.0]
