"""The work queue: dedupe, one holder per key, collapsing re-adds, delays and rate limits."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.runtime.queue import QueueShutDown, WorkQueue
from tests.clocks import FakeClock

pytestmark = [pytest.mark.timeout(30), pytest.mark.loop_guard]

Key = tuple[str, str, str]


def claim(name: str) -> Key:
    return ("ModelClaim", "default", name)


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def take_ready(queue: WorkQueue[Key]) -> list[Key]:
    """Every ready key, in order (each now held by the test until ``done``)."""
    return [await queue.get() for _ in range(len(queue))]


# -- dedupe and ordering ----------------------------------------------------------------------------

async def test_adding_a_queued_key_again_queues_it_once() -> None:
    queue: WorkQueue[Key] = WorkQueue(FakeClock())
    for _ in range(3):
        queue.add(claim("a"))
    queue.add(claim("b"))
    assert len(queue) == 2
    assert await take_ready(queue) == [claim("a"), claim("b")]


async def test_keys_come_out_in_the_order_they_were_first_added() -> None:
    queue: WorkQueue[Key] = WorkQueue(FakeClock())
    for name in ["c", "a", "b", "a", "c"]:
        queue.add(claim(name))
    assert await take_ready(queue) == [claim("c"), claim("a"), claim("b")]


# -- one holder per key --------------------------------------------------------------------------

async def test_a_key_being_processed_is_not_handed_out_again() -> None:
    queue: WorkQueue[Key] = WorkQueue(FakeClock())
    queue.add(claim("a"))
    assert await queue.get() == claim("a")
    queue.add(claim("a"))
    assert len(queue) == 0
    second = asyncio.create_task(queue.get())
    await settle()
    assert not second.done()
    queue.done(claim("a"))
    assert await asyncio.wait_for(second, 1) == claim("a")


async def test_re_adds_during_processing_collapse_into_exactly_one_later_run() -> None:
    queue: WorkQueue[Key] = WorkQueue(FakeClock())
    queue.add(claim("a"))
    key = await queue.get()
    for _ in range(5):
        queue.add(key)
    queue.done(key)
    assert await take_ready(queue) == [key]
    queue.done(key)
    assert len(queue) == 0 and queue.processing == frozenset()


async def test_a_key_not_added_during_processing_is_not_requeued() -> None:
    queue: WorkQueue[Key] = WorkQueue(FakeClock())
    queue.add(claim("a"))
    queue.done(await queue.get())
    queue.done(claim("a"))  # a stray second done changes nothing
    assert len(queue) == 0


@given(st.lists(st.tuples(st.sampled_from(["add", "get", "done"]), st.sampled_from("abc")),
                max_size=60))
def test_no_sequence_of_operations_puts_a_key_in_two_places(
        ops: list[tuple[str, str]]) -> None:
    async def scenario() -> None:
        queue: WorkQueue[str] = WorkQueue(FakeClock())
        wanted: set[str] = set()  # the model: keys added since they were last handed out
        held: set[str] = set()
        for op, key in ops:
            if op == "add":
                queue.add(key)
                wanted.add(key)
            elif op == "get" and len(queue):
                got = await queue.get()
                assert got not in held
                held.add(got)
                wanted.discard(got)
            elif op == "done" and key in held:
                queue.done(key)
                held.discard(key)
            ready = list(queue._queue)  # noqa: SLF001 - the invariant is about internals
            assert len(ready) == len(set(ready))
            assert not set(ready) & held
            assert set(ready) | (wanted & held) == wanted
            assert queue.processing == held

    asyncio.run(scenario())


# -- delays ----------------------------------------------------------------------------------------

async def test_add_after_delivers_the_key_once_its_delay_has_passed() -> None:
    clock = FakeClock()
    queue: WorkQueue[Key] = WorkQueue(clock)
    queue.add_after(claim("a"), 10.0)
    await settle()
    assert len(queue) == 0 and queue.waiting == {claim("a"): 10.0}
    clock.advance(9.9)
    await settle()
    assert len(queue) == 0
    clock.advance(0.1)
    await settle()
    assert await take_ready(queue) == [claim("a")]
    assert queue.waiting == {}


async def test_delayed_keys_arrive_in_deadline_order_not_in_add_order() -> None:
    clock = FakeClock()
    queue: WorkQueue[Key] = WorkQueue(clock)
    queue.add_after(claim("slow"), 30.0)
    queue.add_after(claim("fast"), 1.0)
    queue.add_after(claim("mid"), 5.0)
    arrived: list[Key] = []
    for _ in range(3):
        await settle()  # the delay timer goes to sleep on the clock
        deadline = clock.next_deadline()
        assert deadline is not None
        clock.advance(deadline - clock.now())
        await settle()
        arrived += await take_ready(queue)
    assert arrived == [claim("fast"), claim("mid"), claim("slow")]
    assert clock.now() == 30.0


async def test_an_earlier_delay_wins_over_a_later_one() -> None:
    clock = FakeClock()
    queue: WorkQueue[Key] = WorkQueue(clock)
    queue.add_after(claim("a"), 10.0)
    queue.add_after(claim("a"), 60.0)  # later: ignored
    queue.add_after(claim("a"), 2.0)  # earlier: moves the deadline forward
    assert queue.waiting == {claim("a"): 2.0}
    await settle()
    clock.advance(2.0)
    await settle()
    assert await take_ready(queue) == [claim("a")]
    queue.done(claim("a"))
    clock.advance(100.0)
    await settle()
    assert len(queue) == 0  # the superseded deadlines fire nothing


async def test_a_zero_delay_adds_at_once() -> None:
    queue: WorkQueue[Key] = WorkQueue(FakeClock())
    queue.add_after(claim("a"), 0)
    queue.add_after(claim("b"), -1)
    assert await take_ready(queue) == [claim("a"), claim("b")]


async def test_a_delayed_add_of_a_queued_key_still_dedupes() -> None:
    clock = FakeClock()
    queue: WorkQueue[Key] = WorkQueue(clock)
    queue.add(claim("a"))
    queue.add_after(claim("a"), 1.0)
    await settle()
    clock.advance(1.0)
    await settle()
    assert await take_ready(queue) == [claim("a")]


# -- rate limits -----------------------------------------------------------------------------------

async def test_rate_limited_adds_wait_5ms_10ms_20ms_and_forget_resets_them() -> None:
    clock = FakeClock()
    queue: WorkQueue[Key] = WorkQueue(clock)
    key = claim("a")
    for expected in (0.005, 0.01, 0.02, 0.04):
        start = clock.now()
        queue.add_rate_limited(key)
        assert queue.waiting[key] - start == pytest.approx(expected)
        await settle()
        clock.advance(expected)
        await settle()
        assert await take_ready(queue) == [key]
        queue.done(key)
    assert queue.failures(key) == 4
    queue.forget(key)
    assert queue.failures(key) == 0
    queue.add_rate_limited(key)
    assert queue.waiting[key] - clock.now() == pytest.approx(0.005)


# -- shutdown --------------------------------------------------------------------------------------

async def test_shutdown_wakes_every_waiting_getter() -> None:
    queue: WorkQueue[Key] = WorkQueue(FakeClock())
    getters = [asyncio.create_task(queue.get()) for _ in range(3)]
    await settle()
    queue.shutdown()
    results = await asyncio.gather(*getters, return_exceptions=True)
    assert all(isinstance(r, QueueShutDown) for r in results)


async def test_after_shutdown_nothing_is_handed_out_or_requeued() -> None:
    clock = FakeClock()
    queue: WorkQueue[Key] = WorkQueue(clock)
    queue.add(claim("held"))
    held = await queue.get()
    queue.add(claim("queued"))
    queue.add_after(claim("delayed"), 1.0)
    queue.add(held)
    queue.shutdown()
    with pytest.raises(QueueShutDown):
        await queue.get()
    queue.done(held)  # the in-flight key may still finish
    queue.add(claim("late"))
    clock.advance(5.0)
    await settle()
    assert queue.waiting == {} and queue.processing == frozenset()
    with pytest.raises(QueueShutDown):
        await queue.get()
