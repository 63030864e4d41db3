"""A guard against blocking calls on the event loop, for in-process async tests.

A coroutine that blocks the loop (a ``time.sleep``, a synchronous fsync or HTTP call) stalls
every engine's owner at once. asyncio's debug mode reports each callback that ran longer than
``slow_callback_duration``; the guard turns such a report into a failed test, less the time the
kernel kept the loop's thread waiting for a CPU (its run-queue wait, from
``/proc/self/task/TID/schedstat``): on a loaded machine a callback that ran 30 ms can take 500 ms
of wall time without blocking anything, while a blocking call waits off the run queue. The
time the interpreter spent collecting garbage meanwhile is taken off too: after a thousand tests
in one process a full collection takes 0.2-0.3 s wherever it falls, and says nothing about the
code under test.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

BLOCKING_LIMIT_S = 0.25
SAMPLE_S = 0.01  # how often the run-queue wait is read


def runqueue_wait_reader(tid: int) -> Callable[[], float] | None:
    """Seconds thread ``tid`` has waited on a run queue so far, or None where unknown."""
    path = Path(f"/proc/self/task/{tid}/schedstat")

    def read() -> float:
        return int(path.read_text().split()[1]) / 1e9

    try:
        read()
    except (OSError, IndexError, ValueError):
        return None
    return read


def blocked_s(took_s: float, ended: float, wait_now: float,
              samples: list[tuple[float, float]]) -> float:
    """Of a callback that took ``took_s`` and ended at ``ended`` (monotonic), the time it was
    not waiting for a CPU; ``samples`` are (monotonic, run-queue wait) in time order. Without a
    sample from before it began, all of it counts."""
    i = bisect.bisect_right(samples, (ended - took_s, float("inf"))) - 1
    if i < 0:
        return took_s
    return took_s - max(0.0, wait_now - samples[i][1])


def overlap_s(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    """How much of [start, end] the (start, end) ``spans`` cover; they do not overlap."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)


class _GcPauses:
    """The spans (monotonic) the interpreter spent collecting garbage, while started."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._began: float | None = None

    def _note(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.monotonic()
        elif self._began is not None:
            self.spans.append((self._began, time.monotonic()))
            self._began = None

    def start(self) -> None:
        gc.callbacks.append(self._note)

    def stop(self) -> None:
        gc.callbacks.remove(self._note)


class _SlowCallbacks(logging.Handler):
    def __init__(self, limit_s: float, wait: Callable[[], float] | None) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []
        self.limit_s = limit_s
        self.samples: list[tuple[float, float]] = []
        self._wait = wait
        self.gc = _GcPauses()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True) if wait else None

    def _sample(self) -> None:
        assert self._wait is not None
        while not self._stop.wait(SAMPLE_S):
            self.samples.append((time.monotonic(), self._wait()))

    def start(self) -> None:
        self.gc.start()
        if self._thread is not None:
            self.samples.append((time.monotonic(), self._wait()))  # type: ignore[misc]
            self._thread.start()

    def stop(self) -> None:
        self.gc.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not (message.startswith("Executing ") and " took " in message):
            return
        if (took := re.search(r" took ([\d.]+) seconds$", message)) is not None:
            took_s, ended = float(took.group(1)), time.monotonic()
            blocked = took_s if self._wait is None else blocked_s(
                took_s, ended, self._wait(), list(self.samples))
            blocked -= overlap_s(ended - took_s, ended, list(self.gc.spans))
            if blocked < self.limit_s:
                return  # the rest was waiting for a CPU or collecting garbage
            message += f" ({blocked:.3f} s of it not waiting for a CPU nor collecting garbage)"
        self.seen.append(message)


@contextlib.asynccontextmanager
async def event_loop_guard(limit_s: float = BLOCKING_LIMIT_S) -> AsyncIterator[None]:
    """Raise AssertionError on leaving if any callback blocked the loop for ``limit_s``."""
    loop = asyncio.get_running_loop()
    handler = _SlowCallbacks(limit_s, runqueue_wait_reader(threading.get_native_id()))
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    was_debug, was_limit = loop.get_debug(), loop.slow_callback_duration
    loop.set_debug(True)
    loop.slow_callback_duration = limit_s
    handler.start()
    try:
        yield
    finally:
        handler.stop()
        loop.set_debug(was_debug)
        loop.slow_callback_duration = was_limit
        logger.removeHandler(handler)
    assert not handler.seen, f"the event loop was blocked: {handler.seen}"
