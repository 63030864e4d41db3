"""A ``contract.clock.Clock`` for tests whose time moves only when something sleeps on it.

A watcher loop (the KV keeper's, a pacer's) that waits on its injected clock can be walked
through its waits without waiting: ``SteppedClock`` records each wait asked (a sleep, or a
timer such as the timeout of ``loops.wait_event``) and moves its time to the wait's end at
once: a sleep yields once to the loop, a timer fires at the loop's next turn (unless cancelled
first). After ``limit`` waits a sleeper is cancelled, which ends the loop under test. No event
loop is patched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class _Timer:
    def __init__(self, due: float, callback: Callable[[], None]) -> None:
        self.due, self.callback, self.cancelled = due, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class SteppedClock:
    """Time stands still but for waits; ``asked`` lists them (seconds) in order."""

    def __init__(self, limit: int | None = None, start: float = 1000.0) -> None:
        self.asked: list[float] = []
        self.limit = limit
        self._now = start

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return 1.7e9 + self._now

    def later(self, delay_s: float, callback: Callable[[], None]) -> _Timer:
        self.asked.append(delay_s)
        timer = _Timer(self._now + max(0.0, delay_s), callback)
        asyncio.get_running_loop().call_soon(self._fire, timer)
        return timer

    def _fire(self, timer: _Timer) -> None:
        if not timer.cancelled:
            self._now = max(self._now, timer.due)
            timer.callback()

    async def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        if self.limit is not None and len(self.asked) >= self.limit:
            raise asyncio.CancelledError
        self._now += max(0.0, seconds)
        await asyncio.sleep(0)
