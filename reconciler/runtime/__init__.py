"""A controller runtime after controller-runtime's contract, in asyncio.

Keys (hashable values naming objects, never events) go from sources into a deduplicating work
queue; a controller's workers take each key and call ``reconcile(key)``; failures are retried
per key with exponential backoff, terminal errors are recorded, successes may ask to be looked
at again later. Time comes from an injectable clock, so tests never sleep.

    sources.py  --add(key)-->  queue.py  --get()-->  controller.py  --reconcile(key)-->  you
                                 ^ ratelimit.py, clock.py                  metrics.py
"""

from reconciler.runtime.clock import Clock, FakeClock, RealClock
from reconciler.runtime.controller import Controller, Reconciler, Result, TerminalError
from reconciler.runtime.metrics import ControllerMetrics
from reconciler.runtime.queue import Enqueuer, QueueShutDown, WorkQueue
from reconciler.runtime.ratelimit import ExponentialBackoff, RateLimiter, backoff_delay
from reconciler.runtime.sources import (
    DirectorySource,
    EventFeedSource,
    Source,
    TimerSource,
)

__all__ = [
    "Clock", "Controller", "ControllerMetrics", "DirectorySource", "Enqueuer", "EventFeedSource",
    "ExponentialBackoff", "FakeClock", "QueueShutDown", "RateLimiter", "RealClock", "Reconciler",
    "Result", "Source", "TerminalError", "TimerSource", "WorkQueue", "backoff_delay",
]
