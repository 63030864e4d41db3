"""The clock a timed part reads and schedules on: injected, so tests drive time themselves.

An engine owner reads two times (the monotonic one for durations, the wall one for what its
record and events carry) and schedules callbacks (a restart's backoff, a port retry, a record
write retried). It takes all three from one ``Clock`` in its dependencies, never from the event
loop or ``time`` directly: production passes ``LoopClock``; a test passes a fake that records
what was scheduled and fires it when the test says. It sits in ``contract`` so that both the
agent and the reconciler (``reconciler.runtime.clock``) may use it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None:
        """The callback will not run (a no-op once it ran)."""
        ...


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds; only differences mean anything."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch, for what records and events carry."""
        ...

    def later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` on the event loop once ``delay_s`` have passed on this clock."""
        ...


class LoopClock:
    """The real clock: ``time.monotonic``, ``time.time`` and the running loop's timers."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, delay_s), callback)
