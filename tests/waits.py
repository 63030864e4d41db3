"""Waiting in a test for something that another process or task makes true: one helper, one
argument order, ``until(what, check, timeout_s)``, so every such wait reads the same and fails
the same way: an ``AssertionError`` that says what was awaited (and, with ``explain``, what
the world looked like when the wait gave up).

``check`` is polled until it returns a truthy value, which ``until`` returns. A ``check`` that
blocks (an HTTP call, reading a process's state) passes ``blocking=True`` and runs in a thread,
so the test's event loop keeps serving the servers it hosts; ``until_blocking`` is the same wait
for a synchronous test. (``tests/owner_fakes.py`` keeps its own loop-time ``until`` for now.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

INTERVAL_S = 0.05


def _timed_out(what: str, explain: Callable[[], str] | None) -> AssertionError:
    return AssertionError(f"timed out waiting for {what}" + (f"; {explain()}" if explain else ""))


async def until(what: str, check: Callable[[], T], timeout_s: float = 30.0, *,
                explain: Callable[[], str] | None = None, blocking: bool = False) -> T:
    """``check()``'s first truthy answer; ``AssertionError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await asyncio.to_thread(check) if blocking else check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise _timed_out(what, explain)
        await asyncio.sleep(INTERVAL_S)


def until_blocking(what: str, check: Callable[[], T], timeout_s: float = 30.0, *,
                   explain: Callable[[], str] | None = None) -> T:
    """``until`` for a synchronous test: sleeps between checks."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise _timed_out(what, explain)
        time.sleep(INTERVAL_S)
