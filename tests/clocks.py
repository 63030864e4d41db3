"""The one fake ``contract.clock.Clock`` of the tests: time moves only when a test (or a wait) says.

Every timed part of the product, the agent's and the reconciler's, takes a ``contract.clock.Clock``;
a test hands it a ``FakeClock`` instead of patching the event loop. Its time moves in one of two
ways:

- by hand (the default): ``advance(seconds)`` moves time forward and wakes whatever has come
  due, earliest deadline first: sleepers (their tasks run at the loop's next turn, so a test
  awaits something after it) and timers from ``later`` (their callbacks run inside
  ``advance``, each seeing the clock at its own deadline; one due at once fires at the loop's
  next turn). ``next_deadline`` and ``sleepers``
  say what waits. A sleep of zero or less still yields once to the loop, like
  ``asyncio.sleep(0)``. This drives the reconciler's queue, controller and sources, whose
  waits overlap.
- ``stepped``: every wait moves time to its own end at once: a sleep yields once to the loop,
  a timer fires at the loop's next turn (unless cancelled first). A watcher loop (the KV
  keeper's, a pacer's) is walked through its waits without waiting.

Either way ``asked`` lists every wait asked (seconds, sleeps and timers) in order, and after
``limit`` waits a sleeper is cancelled, which ends the loop under test. ``wall`` is ``epoch``
plus the monotonic time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable


class _Timer:
    def __init__(self, due: float, callback: Callable[[], None]) -> None:
        self.due, self.callback, self.cancelled = due, callback, False

    def cancel(self) -> None:
        self.cancelled = True


_Waiter = asyncio.Future[None] | _Timer


def _pending(waiter: _Waiter) -> bool:
    return not waiter.cancelled if isinstance(waiter, _Timer) else not waiter.done()


class FakeClock:
    """A clock that stands still until ``advance`` (or, ``stepped``, until something waits)."""

    def __init__(self, start: float = 0.0, *, stepped: bool = False, limit: int | None = None,
                 epoch: float = 1.8e9) -> None:
        self.asked: list[float] = []
        self.stepped, self.limit, self.epoch = stepped, limit, epoch
        self._now = start
        self._seq = itertools.count()
        self._waiting: list[tuple[float, int, _Waiter]] = []

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self.epoch + self._now

    def later(self, delay_s: float, callback: Callable[[], None]) -> _Timer:
        self.asked.append(delay_s)
        timer = _Timer(self._now + max(0.0, delay_s), callback)
        heapq.heappush(self._waiting, (timer.due, next(self._seq), timer))
        if self.stepped or delay_s <= 0:  # due now: at the loop's next turn, as on the loop
            asyncio.get_running_loop().call_soon(self._step_to, timer)
        return timer

    async def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        if self.limit is not None and len(self.asked) >= self.limit:
            raise asyncio.CancelledError
        if self.stepped or seconds <= 0:
            self.advance(max(0.0, seconds))
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (self._now + seconds, next(self._seq), future))
        await future  # a cancelled sleeper's future is cancelled too, and skipped by advance

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` and wake every sleeper and timer now due."""
        if seconds < 0:
            raise ValueError("a clock never goes back")
        target = self._now + seconds
        while self._waiting and self._waiting[0][0] <= target:
            due, _, waiter = heapq.heappop(self._waiting)
            self._now = max(self._now, due)
            if isinstance(waiter, _Timer):
                if not waiter.cancelled:
                    waiter.cancelled = True  # it ran: a later cancel is a no-op
                    waiter.callback()
            elif not waiter.done():
                waiter.set_result(None)
        self._now = target

    def _step_to(self, timer: _Timer) -> None:
        if not timer.cancelled:
            self.advance(max(0.0, timer.due - self._now))

    def next_deadline(self) -> float | None:
        """When the earliest pending sleeper or timer is due, or None when nothing waits."""
        self._drop_settled()
        return self._waiting[0][0] if self._waiting else None

    @property
    def sleepers(self) -> int:
        """How many tasks sleep on this clock now."""
        self._drop_settled()
        return sum(1 for _, _, w in self._waiting if not isinstance(w, _Timer) and not w.done())

    def _drop_settled(self) -> None:
        while self._waiting and not _pending(self._waiting[0][2]):
            heapq.heappop(self._waiting)
