"""The blocking-call guard of the test suite fails a test that blocks its event loop."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from tests.guards import blocked_s, event_loop_guard, overlap_s, runqueue_wait_reader


@pytest.mark.allow_blocking
async def test_a_blocking_sleep_on_the_loop_fails_the_guard() -> None:
    with pytest.raises(AssertionError, match="event loop was blocked"):
        async with event_loop_guard(0.05):
            await asyncio.sleep(0)
            time.sleep(0.2)  # blocks the loop, as a synchronous disk or HTTP call would
            await asyncio.sleep(0)


@pytest.mark.allow_blocking
async def test_work_moved_to_a_thread_passes_the_guard() -> None:
    async with event_loop_guard(0.05):
        await asyncio.to_thread(time.sleep, 0.2)


@pytest.mark.allow_blocking
async def test_a_garbage_collection_on_the_loop_passes_the_guard() -> None:
    def slow_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            time.sleep(0.2)  # a full collection of a large heap, made long on purpose

    async with event_loop_guard(0.05):
        gc.callbacks.append(slow_collection)  # after the guard's own: inside its span
        try:
            await asyncio.sleep(0)
            gc.collect()
            await asyncio.sleep(0)
        finally:
            gc.callbacks.remove(slow_collection)


def test_only_the_part_of_a_callback_spent_collecting_is_taken_off() -> None:
    spans = [(9.0, 10.2), (10.4, 10.5), (12.0, 13.0)]
    assert overlap_s(10.0, 11.0, spans) == pytest.approx(0.3)
    assert overlap_s(11.0, 11.9, spans) == 0.0


def test_time_spent_waiting_for_a_cpu_is_not_counted_as_blocked() -> None:
    samples = [(10.0, 1.0), (10.5, 1.0), (11.0, 1.2)]
    # Took 0.5 s, ended at 11.5 (began 11.0): 0.4 s of it waited on the run queue.
    assert blocked_s(0.5, 11.5, 1.6, samples) == pytest.approx(0.1)
    # A sleep: no run-queue wait while it lasted, so all of it counts.
    assert blocked_s(0.5, 11.5, 1.2, samples) == pytest.approx(0.5)
    # No sample from before it began: all of it counts.
    assert blocked_s(5.0, 11.5, 9.0, samples) == pytest.approx(5.0)


def test_the_run_queue_wait_of_this_thread_can_be_read() -> None:
    import threading

    read = runqueue_wait_reader(threading.get_native_id())
    assert read is not None  # Linux with schedstat: the guard's correction is in force
    first = read()
    assert first >= 0.0 and read() >= first
