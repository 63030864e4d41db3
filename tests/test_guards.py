"""The blocking-call guard of the test suite fails a test that blocks its event loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.guards import event_loop_guard


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
