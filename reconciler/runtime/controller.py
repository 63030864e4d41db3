"""The controller: N workers that take keys from a work queue and reconcile them.

controller-runtime's contract. For each key a worker calls ``reconcile(key)`` and then:

- it returned ``Result()``: success, the key's failures are forgotten;
- it returned ``Result(requeue_after=s)``: success, forgotten, and the key comes back in ``s``
  seconds (level-based polling of something no event announces);
- it raised ``TerminalError``: recorded (``last_terminal_error``), forgotten, not retried; the
  next change to the object brings the key back;
- it raised anything else: logged and retried after the key's exponential backoff
  (5 ms, 10 ms, ... 1000 s).

The queue guarantees one worker per key, so a reconciler never races itself on one object.
``stop`` stops the sources, shuts the queue, and waits for in-flight reconciles (optionally only
for ``grace`` seconds, after which they are cancelled).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry

from contract.clock import Clock, LoopClock
from reconciler.runtime.metrics import ControllerMetrics, ControllerSeries
from reconciler.runtime.queue import QueueShutDown, WorkQueue
from reconciler.runtime.sources import Source

log = logging.getLogger("reconciler.runtime.controller")

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)


@dataclass(frozen=True)
class Result:
    """What a reconcile asks for next: nothing, or another look in ``requeue_after`` seconds."""

    requeue_after: float | None = None


class TerminalError(Exception):
    """A failure that retrying cannot fix (an invalid spec): recorded, never retried."""


class Reconciler(Protocol[K_contra]):
    async def reconcile(self, key: K_contra) -> Result:
        """Make the world match the desired state of the object ``key`` names."""
        ...


class Controller(Generic[K]):
    """``workers`` tasks reconciling keys from ``queue``, one key per worker at a time.

    ``metrics`` is a ``ControllerMetrics``, or a ``CollectorRegistry`` (whose families are then
    shared by every controller given that registry), or None for a private registry.
    ``clock`` times the reconciles and the stop grace period. A controller starts once.
    """

    def __init__(self, name: str, reconciler: Reconciler[K], queue: WorkQueue[K], *,
                 workers: int = 1, clock: Clock | None = None,
                 metrics: ControllerMetrics | CollectorRegistry | None = None) -> None:
        if workers < 1:
            raise ValueError("a controller needs at least one worker")
        self.name = name
        self._reconciler = reconciler
        self._queue = queue
        self._workers = workers
        self._clock: Clock = clock or LoopClock()
        if isinstance(metrics, CollectorRegistry):
            metrics = ControllerMetrics.shared(metrics)
        self.metrics = metrics or ControllerMetrics()
        self._series: ControllerSeries = self.metrics.for_controller(name, queue)
        self._sources: list[Source[K]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._terminal: dict[K, TerminalError] = {}

    @property
    def queue(self) -> WorkQueue[K]:
        return self._queue

    @property
    def running(self) -> bool:
        return any(not task.done() for task in self._tasks)

    def watch(self, source: Source[K]) -> None:
        """Feed ``source``'s keys into this controller's queue (started with the controller)."""
        self._sources.append(source)
        if self._tasks:
            source.start(self._queue)

    def last_terminal_error(self, key: K) -> TerminalError | None:
        """The terminal error of ``key``'s latest reconcile, None once a later one ends otherwise."""
        return self._terminal.get(key)

    def start(self) -> None:
        """Start the workers, then the sources (a key enqueued at start is not lost either way)."""
        if self._tasks:
            raise RuntimeError(f"controller {self.name} is already started")
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._work(), name=f"{self.name}-worker-{i}")
                       for i in range(self._workers)]
        for source in self._sources:
            source.start(self._queue)

    async def stop(self, grace: float | None = None) -> None:
        """Stop sources and queue, let in-flight reconciles finish, then return.

        With ``grace``, reconciles still running after ``grace`` seconds on the controller's
        clock are cancelled.
        """
        for source in self._sources:
            await source.stop()
        self._queue.shutdown()
        if not self._tasks:
            return
        workers = asyncio.gather(*self._tasks, return_exceptions=True)
        if grace is not None:
            timer = asyncio.ensure_future(self._clock.sleep(grace))
            either: set[asyncio.Future[Any]] = {workers, timer}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            timer.cancel()
            if not workers.done():
                log.warning("controller %s: cancelling reconciles still running after %.1fs",
                            self.name, grace, extra={"controller": self.name})
                for task in self._tasks:
                    task.cancel()
        await workers

    async def _work(self) -> None:
        while True:
            try:
                key = await self._queue.get()
            except QueueShutDown:
                return
            try:
                await self._reconcile(key)
            finally:
                self._queue.done(key)

    async def _reconcile(self, key: K) -> None:
        series = self._series
        series.active_workers.inc()
        started = self._clock.now()
        try:
            result = await self._reconciler.reconcile(key)
        except TerminalError as err:
            self._terminal[key] = err
            self._queue.forget(key)
            series.count("terminal")
            log.error("controller %s: %r failed terminally, not retrying: %s", self.name, key,
                      err, extra={"controller": self.name, "key": repr(key)})
        except Exception:
            self._terminal.pop(key, None)
            self._queue.add_rate_limited(key)
            series.count("error")
            log.exception("controller %s: reconcile of %r failed (failure %d), retrying",
                          self.name, key, self._queue.failures(key),
                          extra={"controller": self.name, "key": repr(key)})
        else:
            self._terminal.pop(key, None)
            self._queue.forget(key)
            if result.requeue_after is not None:
                self._queue.add_after(key, result.requeue_after)
                series.count("requeue")
            else:
                series.count("success")
        finally:
            series.duration.observe(max(0.0, self._clock.now() - started))
            series.active_workers.dec()
