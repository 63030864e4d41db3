"""The agent's survival helpers: loops that restart after errors and a shutdown in stages."""

from __future__ import annotations

import asyncio
import logging

import pytest

from runtime_agent.loops import Throttled, keep_running, run_stages

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
