"""Background loops that survive: a loop that fails is logged once per interval and restarted.

The agent's watchers (KV holding, health probes, scrapes, memory sampling, log trimming) run for
an engine's whole life. A transient error (file descriptors exhausted for a few seconds, a peer
that resets, memory pressure) must not end one for good, nor fill the log with one line per
retry: ``keep_running`` restarts the loop after a growing pause, and ``Throttled`` logs a
repeated error once per interval with the count of the ones it held back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from contract.clock import Clock, LoopClock


class Throttled:
    """Log one message per key at most every ``interval_s``; say how many were held back."""

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._interval = interval_s
        self._clock = clock
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log it (True) unless the same key was logged within the interval (False)."""
        now = self._clock()
        last, held = self._last.get(key, (float("-inf"), 0))
        if now - last < self._interval:
            self._last[key] = (last, held + 1)
            return False
        suffix = f" ({held} more like it since the last report)" if held else ""
        self._log.warning(message + suffix, *args)
        self._last[key] = (now, 0)
        return True


async def keep_running(name: str, loop: Callable[[], Awaitable[None]], throttled: Throttled,
                       first_pause_s: float = 0.1, max_pause_s: float = 5.0,
                       clock: Clock | None = None) -> None:
    """Run ``loop()`` until it returns or is cancelled; after an error, log (throttled), wait
    a growing pause on ``clock`` (the loop's by default) and run it again. The pause starts over
    after a run that lasted a while."""
    clock = clock or LoopClock()
    pause = first_pause_s
    while True:
        started = clock.now()
        try:
            await loop()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure: log it and start again
            throttled.warning(name, "%s failed (%s: %s); restarting it", name,
                              type(exc).__name__, exc)
        if clock.now() - started > 10 * max_pause_s:
            pause = first_pause_s
        await clock.sleep(pause)
        pause = min(max_pause_s, pause * 2)


async def wait_event(event: asyncio.Event, timeout_s: float, clock: Clock | None = None) -> bool:
    """Wait for ``event`` at most ``timeout_s`` on ``clock`` (the loop's by default); True
    when it is set.

    The wait is a task of its own that a timer on the clock cancels, awaited with
    ``asyncio.wait``, which never swallows a cancel of the caller. Not ``asyncio.wait_for``: on
    Python 3.11 it returns normally when a cancel arrives in the loop turn the event is set in,
    dropping the cancel, and a ``while True`` loop around it then never ends (a stop that
    hangs). Not ``asyncio.timeout`` either: it reads the loop's time, which a test's clock
    does not drive."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())

    def give_up() -> None:
        waiter.cancel()

    timer = (clock or LoopClock()).later(timeout_s, give_up)
    try:
        await asyncio.wait({waiter})
    finally:
        timer.cancel()
        waiter.cancel()
    return event.is_set()


async def run_stages(stages: list[tuple[str, float, Callable[[], Awaitable[object]]]],
                     logger: logging.Logger) -> list[str]:
    """Run shutdown stages in order, each under its own timeout (seconds); a stage that hangs or
    fails is logged and left behind so the later ones still run (the last stages release what a
    successor needs, such as the state-directory lock). Returns the stages that did not finish.
    """
    unfinished: list[str] = []
    for name, timeout_s, stage in stages:
        began = time.monotonic()
        # A task of its own, waited for with asyncio.wait: bounded even when the stage ignores
        # its cancel (asyncio.wait_for would wait for the cancelled stage to end).
        task = asyncio.ensure_future(stage())
        await asyncio.wait({task}, timeout=timeout_s)
        if not task.done():
            task.cancel()
            task.add_done_callback(_ignore_result)  # it may end later; nobody will read it
            unfinished.append(name)
            logger.warning("shutdown: %s did not finish within %.1f s; going on", name, timeout_s)
        elif not task.cancelled() and (exc := task.exception()) is not None:
            unfinished.append(name)
            logger.warning("shutdown: %s failed (%s: %s); going on", name, type(exc).__name__, exc)
        else:
            logger.debug("shutdown: %s took %.3f s", name, time.monotonic() - began)
    return unfinished


def _ignore_result(task: asyncio.Future[object]) -> None:
    if not task.cancelled():
        task.exception()
