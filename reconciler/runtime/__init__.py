"""A controller runtime after controller-runtime's contract, in asyncio.

Keys (hashable values naming objects, never events) go from sources into a deduplicating work
queue; a controller's workers take each key and call ``reconcile(key)``; failures are retried
per key with exponential backoff, terminal errors are recorded, successes may ask to be looked
at again later. Time comes from the injected ``contract.clock.Clock`` (the agent's too), so
tests never sleep.

    sources.py  --add(key)-->  queue.py  --get()-->  controller.py  --reconcile(key)-->  you
                                 ^ ratelimit.py, contract.clock             metrics.py

``tasks.py`` stops a part's background task (cancel, then wait until it has finished).
"""

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
    "Controller", "ControllerMetrics", "DirectorySource", "Enqueuer", "EventFeedSource",
    "ExponentialBackoff", "QueueShutDown", "RateLimiter", "Reconciler", "Result", "Source",
    "TerminalError", "TimerSource", "WorkQueue", "backoff_delay",
]
