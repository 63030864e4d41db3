"""The agent's survival helpers: loops that restart after errors and a shutdown in stages."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from runtime_agent.loops import Throttled, keep_running, run_stages, wait_event
from tests.clocks import FakeClock

pytestmark = pytest.mark.loop_guard

log = logging.getLogger("test-loops")


async def test_a_hanging_stage_is_left_behind_and_the_later_stages_still_run(
        caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []
    hung = asyncio.Event()

    async def hangs() -> None:
        hung.set()
        await asyncio.Event().wait()

    async def fails() -> None:
        raise OSError("disk gone")

    async def releases() -> None:
        ran.append("released")

    async def first() -> None:
        ran.append("first")

    caplog.set_level(logging.WARNING)
    unfinished = await run_stages([("first", 1.0, first), ("the hang", 0.05, hangs),
                                   ("the failure", 1.0, fails), ("release", 1.0, releases)], log)
    assert unfinished == ["the hang", "the failure"]
    assert ran == ["first", "released"] and hung.is_set()
    assert "the hang did not finish within 0.1 s" in caplog.text
    assert "the failure failed (OSError: disk gone)" in caplog.text


async def test_keep_running_restarts_a_failing_loop_and_logs_the_repeats_once() -> None:
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs < 4:
            raise ConnectionResetError("peer reset")

    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test-loops-throttled")
    logger.addHandler(Capture())
    await keep_running("flaky", flaky, Throttled(logger, interval_s=60), first_pause_s=0.001)
    assert runs == 4  # returned after the first clean run
    assert records == ["flaky failed (ConnectionResetError: peer reset); restarting it"]


async def test_a_stage_that_ignores_its_cancel_is_left_behind_in_its_time() -> None:
    released = asyncio.Event()
    let_go = asyncio.Event()
    cancels = 0

    async def stubborn() -> None:
        nonlocal cancels
        while not let_go.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancels += 1  # swallowed, as a loop around a 3.11 wait_for can

    async def release() -> None:
        released.set()

    began = time.monotonic()
    unfinished = await run_stages([("stubborn", 0.1, stubborn), ("release", 1.0, release)],
                                  logging.getLogger("test-loops"))
    assert unfinished == ["stubborn"] and released.is_set() and cancels == 1
    assert time.monotonic() - began < 1.0
    let_go.set()  # let the stage end, so that the test's loop can close
    for task in asyncio.all_tasks() - {asyncio.current_task()}:
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)


async def test_wait_event_keeps_a_cancel_that_comes_with_the_event() -> None:
    event = asyncio.Event()
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            await wait_event(event, 10)
            event.clear()
            rounds += 1

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # the loop waits for the event
    event.set()
    task.cancel()  # in the same turn: asyncio.wait_for on 3.11 drops this cancel
    await asyncio.wait({task}, timeout=2.0)
    assert task.cancelled() and rounds == 0


async def test_wait_event_says_whether_the_event_came() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_soon(event.set)
    assert await wait_event(event, 5.0) is True


async def test_wait_event_times_out_on_the_clock_it_is_given() -> None:
    clock = FakeClock(1000.0, stepped=True)
    async with asyncio.timeout(5):  # an hour on the clock, none on the loop
        assert await wait_event(asyncio.Event(), 3600.0, clock) is False
    assert clock.asked == [3600.0] and clock.now() == 1000.0 + 3600.0


async def test_keep_running_pauses_on_the_clock_it_is_given() -> None:
    clock, runs = FakeClock(1000.0, stepped=True), 0

    async def fails_three_times() -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise OSError("EMFILE")

    async with asyncio.timeout(5):  # 0.7 s of pauses on the clock, none on the loop
        await keep_running("flaky", fails_three_times, Throttled(log), first_pause_s=0.1,
                           clock=clock)
    assert runs == 4 and clock.asked == [0.1, 0.2, 0.4]
