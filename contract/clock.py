"""The clock a timed part reads and schedules on: injected, so tests drive time themselves.

An engine owner reads two times (the monotonic one for durations, the wall one for what its
record and events carry) and schedules callbacks (a restart's backoff, a port retry, a record
write retried). It takes all three from one ``Clock`` in its dependencies, never from the event
loop or ``time`` directly: production passes ``LoopClock``; a test passes a fake that records
what was scheduled and fires it when the test says. The agent's watchers, pacers, KV keeper and
memory broker wait on the same clock (``sleep``), so one fake drives all of them. It sits in
``contract`` so that the reconciler takes the same one: its work queue's delayed adds, its
controllers' durations, its sources' intervals and reconnect backoff, its informers, leader
election and Events, and the wall time its statuses carry. The tests' one fake is
``tests/clocks.FakeClock``.
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

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock (at the next turn for ``<= 0``)."""
        ...


class LoopClock:
    """The real clock: ``time.monotonic``, ``time.time``, the running loop's timers and
    ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, delay_s), callback)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))
