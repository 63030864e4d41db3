"""Controller metrics: one set of families per registry, one label value per controller.

The families are created once per ``CollectorRegistry`` (prometheus-client refuses a name twice)
and shared by every controller that registers with them; ``for_controller`` creates each
controller's series at once, so a dashboard sees ``reconcile_total{result="error"} 0`` before the
first error rather than no series at all.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sized
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

RESULTS = ("success", "error", "requeue", "terminal")
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class ControllerSeries:
    """One controller's children of the shared families."""

    results: dict[str, Counter]
    duration: Histogram
    active_workers: Gauge
    depth: Gauge

    def count(self, result: str) -> None:
        self.results[result].inc()


class ControllerMetrics:
    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, ControllerMetrics] = \
        weakref.WeakKeyDictionary()

    @classmethod
    def shared(cls, registry: CollectorRegistry) -> ControllerMetrics:
        """The families registered in ``registry``, created on first use (no prefix)."""
        metrics = cls._by_registry.get(registry)
        if metrics is None:
            metrics = cls._by_registry[registry] = cls(registry)
        return metrics

    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.reconcile_total = Counter(
            prefix + "reconcile_total", "Reconciles by controller and result.",
            ["controller", "result"], registry=self.registry)
        self.reconcile_time = Histogram(
            prefix + "reconcile_time_seconds", "Time spent in reconcile, by controller.",
            ["controller"], buckets=DURATION_BUCKETS, registry=self.registry)
        self.active_workers = Gauge(
            prefix + "active_workers", "Workers reconciling a key now, by controller.",
            ["controller"], registry=self.registry)
        self.workqueue_depth = Gauge(
            prefix + "workqueue_depth", "Keys ready and waiting for a worker, by controller.",
            ["controller"], registry=self.registry)

    def for_controller(self, name: str, queue: Sized) -> ControllerSeries:
        """Create ``name``'s series, all at zero; the depth is read from ``queue`` at scrape."""
        depth = self.workqueue_depth.labels(controller=name)
        depth.set_function(_length_of(queue))
        active = self.active_workers.labels(controller=name)
        active.set(0)
        return ControllerSeries(
            results={r: self.reconcile_total.labels(controller=name, result=r) for r in RESULTS},
            duration=self.reconcile_time.labels(controller=name),
            active_workers=active,
            depth=depth,
        )


def _length_of(queue: Sized) -> Callable[[], float]:
    return lambda: float(len(queue))
