"""The work queue: keys waiting to be reconciled, each handed to at most one worker at a time.

A key names an object (``("ModelClaim", "default", "qwen3-0-6b")``), never an event: the
reconciler reads the current state itself, so ten changes to one object while it waits are one
reconcile. The queue is client-go's workqueue in asyncio:

- ``dirty``: keys that need a reconcile (queued, or marked during processing);
- ``queue``: the dirty keys not being processed, in FIFO order (what ``get`` hands out);
- ``processing``: keys a worker holds between ``get`` and ``done``.

So ``add`` of a queued key is a no-op; ``add`` of a key being processed marks it dirty, and
``done`` puts it back exactly once however many adds came in. A key is never in ``queue`` and
``processing`` at once, which is what keeps two workers off one key.

Delayed adds wait in a heap with one deadline per key (the earliest wins); one timer task
sleeps on the injected clock until the earliest deadline. ``shutdown`` drops what waits, wakes
every getter with ``QueueShutDown`` and lets in-flight keys finish (``done`` still works).
Everything here runs on the event loop without awaiting between a check and its change, so no
lock is needed.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from contract.clock import Clock, LoopClock
from reconciler.runtime.ratelimit import ExponentialBackoff, RateLimiter

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)


class Enqueuer(Protocol[K_contra]):
    """Where sources put keys: ``WorkQueue`` is one."""

    def add(self, key: K_contra) -> None: ...


class QueueShutDown(Exception):
    """``get`` on a queue that is shut down: the worker should exit."""


class WorkQueue(Generic[K]):
    def __init__(self, clock: Clock | None = None,
                 rate_limiter: RateLimiter | None = None) -> None:
        self._clock: Clock = clock or LoopClock()
        self._limiter: RateLimiter = rate_limiter or ExponentialBackoff()
        self._queue: deque[K] = deque()
        self._dirty: set[K] = set()
        self._processing: set[K] = set()
        self._ready = asyncio.Event()  # set iff the queue holds a key or is shut down
        self._shut_down = False
        # Delayed adds: key -> deadline, and a heap of (deadline, seq, key) that may hold stale
        # entries (a key whose deadline moved earlier); an entry counts only if it matches.
        self._waiting: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()
        self._timer: asyncio.Task[None] | None = None
        self._timer_target = 0.0

    # -- adding ---------------------------------------------------------------------------------

    def add(self, key: K) -> None:
        """Mark ``key`` for a reconcile: queued once, or once more after its current run."""
        if self._shut_down or key in self._dirty:
            return
        self._dirty.add(key)
        if key in self._processing:
            return  # ``done`` re-queues it
        self._queue.append(key)
        self._ready.set()

    def add_after(self, key: K, delay: float) -> None:
        """``add(key)`` once ``delay`` seconds have passed; an earlier pending deadline wins."""
        if self._shut_down:
            return
        if delay <= 0:
            self.add(key)
            return
        deadline = self._clock.now() + delay
        pending = self._waiting.get(key)
        if pending is not None and pending <= deadline:
            return
        self._waiting[key] = deadline
        heapq.heappush(self._heap, (deadline, next(self._seq), key))
        self._arm()

    def add_rate_limited(self, key: K) -> None:
        """Retry ``key`` after the rate limiter's delay for its failure count (which it bumps)."""
        self.add_after(key, self._limiter.when(key))

    def forget(self, key: K) -> None:
        """Reset ``key``'s failure count: its next ``add_rate_limited`` waits the base delay."""
        self._limiter.forget(key)

    def failures(self, key: K) -> int:
        """How many rate-limited retries ``key`` has had since it was last forgotten."""
        return self._limiter.failures(key)

    # -- working ----------------------------------------------------------------------------------

    async def get(self) -> K:
        """The next ready key, now held by the caller until ``done(key)``.

        Raises ``QueueShutDown`` once the queue is shut down, even if keys were still queued.
        """
        while True:
            if self._shut_down:
                raise QueueShutDown
            if self._queue:
                key = self._queue.popleft()
                if not self._queue:
                    self._ready.clear()
                self._processing.add(key)
                self._dirty.discard(key)
                return key
            await self._ready.wait()

    def done(self, key: K) -> None:
        """Release ``key``; if it was added meanwhile, queue it again (once)."""
        if key not in self._processing:
            return
        self._processing.discard(key)
        if key in self._dirty and not self._shut_down:
            self._queue.append(key)
            self._ready.set()

    def shutdown(self) -> None:
        """Stop handing out keys: getters raise ``QueueShutDown``, delayed adds are dropped."""
        self._shut_down = True
        self._ready.set()
        self._waiting.clear()
        self._heap.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- reading ------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Keys ready to be handed out (the queue depth)."""
        return len(self._queue)

    @property
    def processing(self) -> frozenset[K]:
        return frozenset(self._processing)

    @property
    def waiting(self) -> dict[K, float]:
        """Delayed keys and the clock time each is due."""
        return dict(self._waiting)

    @property
    def shutting_down(self) -> bool:
        return self._shut_down

    # -- the delay timer ------------------------------------------------------------------------------

    def _arm(self) -> None:
        """Make sure one timer sleeps until the earliest valid deadline (and no later)."""
        while self._heap and self._waiting.get(self._heap[0][2]) != self._heap[0][0]:
            heapq.heappop(self._heap)  # stale: the key's deadline moved or it already fired
        if not self._heap:
            return
        target = self._heap[0][0]
        if self._timer is not None and not self._timer.done():
            if self._timer_target <= target:
                return
            self._timer.cancel()
        self._timer_target = target
        self._timer = asyncio.get_running_loop().create_task(
            self._fire_at(target), name="workqueue-delay")

    async def _fire_at(self, target: float) -> None:
        await self._clock.sleep(target - self._clock.now())
        self._timer = None
        now = self._clock.now()
        while self._heap and self._heap[0][0] <= now:
            deadline, _, key = heapq.heappop(self._heap)
            if self._waiting.get(key) == deadline:
                del self._waiting[key]
                self.add(key)
        self._arm()
