"""A guard against blocking calls on the event loop, for in-process async tests.

A coroutine that blocks the loop (a ``time.sleep``, a synchronous fsync or HTTP call) stalls
every engine's owner at once. asyncio's debug mode reports each callback that ran longer than
``slow_callback_duration``; the guard turns such a report into a failed test.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

BLOCKING_LIMIT_S = 0.25


class _SlowCallbacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing ") and " took " in message:
            self.seen.append(message)


@contextlib.asynccontextmanager
async def event_loop_guard(limit_s: float = BLOCKING_LIMIT_S) -> AsyncIterator[None]:
    """Raise AssertionError on leaving if any callback blocked the loop for ``limit_s``."""
    loop = asyncio.get_running_loop()
    handler = _SlowCallbacks()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    was_debug, was_limit = loop.get_debug(), loop.slow_callback_duration
    loop.set_debug(True)
    loop.slow_callback_duration = limit_s
    try:
        yield
    finally:
        loop.set_debug(was_debug)
        loop.slow_callback_duration = was_limit
        logger.removeHandler(handler)
    assert not handler.seen, f"the event loop was blocked: {handler.seen}"
