"""The ModelClaim controller's metrics, under the guide's names.

Per claim (read from the status store at scrape time, so a deleted claim's series go with it):
``aibrix_modelclaim_desired_replicas``, ``aibrix_modelclaim_ready_replicas``,
``aibrix_modelclaim_activating`` (1 while its engine starts) and
``aibrix_modelclaim_no_ready_duration_seconds`` (how long it has not been ready). Per pool:
``aibrix_modelclaim_pool_policy_valid`` (read from the manifests),
``aibrix_modelclaim_pool_policy_evaluations_total`` (sleep-policy evaluations) and
``aibrix_modelclaim_pool_policy_actions_total{action}`` (sleeps, wakes, sleeps to make room,
moves). ``aibrix_modelclaim_activation_total{result}``: engine starts by result (success:
the agent started it; refused: the agent had no room; failed: an error or no answer; invalid:
InvalidEngineConfig). The runtime's reconcile metrics share the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from reconciler.desired import Desired
from reconciler.status import ACTIVATING
from reconciler.store import StatusStore

ACTIVATION_RESULTS = ("success", "refused", "failed", "invalid")


class _ClaimCollector(Collector):
    def __init__(self, store: StatusStore, desired: Desired,
                 wall: Callable[[], float]) -> None:
        self._store = store
        self._desired = desired
        self._wall = wall

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["namespace", "name"]
        desired = GaugeMetricFamily("aibrix_modelclaim_desired_replicas",
                                    "Engines a claim asks for (spec.replicas).", labels=labels)
        ready = GaugeMetricFamily("aibrix_modelclaim_ready_replicas",
                                  "Engines of a claim that serve.", labels=labels)
        activating = GaugeMetricFamily("aibrix_modelclaim_activating",
                                       "1 while a claim's engine starts.", labels=labels)
        no_ready = GaugeMetricFamily("aibrix_modelclaim_no_ready_duration_seconds",
                                     "Seconds a claim has not been ready (0 while ready).",
                                     labels=labels)
        now = self._wall()
        for st in self._store.claims():
            if st.deleted is not None:
                continue
            key = [st.namespace, st.name]
            phase, ready_replicas, _, _ = st.summary()
            desired.add_metric(key, st.desired_replicas)
            ready.add_metric(key, ready_replicas)
            activating.add_metric(key, 1 if phase == ACTIVATING else 0)
            since = st.not_ready_since if not ready_replicas else None
            no_ready.add_metric(key, max(0.0, now - since) if since is not None else 0.0)
        valid = GaugeMetricFamily("aibrix_modelclaim_pool_policy_valid",
                                  "1 when a pool's sleep policy is valid, 0 when it was turned "
                                  "off.", labels=["namespace", "pool"])
        for pool in self._desired.pools:
            valid.add_metric([pool.namespace, pool.name], 1 if pool.policy_valid else 0)
        return [desired, ready, activating, no_ready, valid]


class ClaimMetrics:
    """The counters the reconcilers bump, and the scrape-time gauges."""

    def __init__(self, registry: CollectorRegistry, store: StatusStore, desired: Desired,
                 wall: Callable[[], float]) -> None:
        self.registry = registry
        self.activations = Counter("aibrix_modelclaim_activation_total",
                                   "Engine starts by result.", ["result"], registry=registry)
        for result in ACTIVATION_RESULTS:
            self.activations.labels(result=result)
        self.evaluations = Counter("aibrix_modelclaim_pool_policy_evaluations_total",
                                   "Sleep-policy evaluations, per pool.", ["pool"],
                                   registry=registry)
        self.actions = Counter("aibrix_modelclaim_pool_policy_actions_total",
                               "Sleep-policy actions, per pool and action.", ["pool", "action"],
                               registry=registry)
        registry.register(_ClaimCollector(store, desired, wall))

    def activation(self, result: str) -> None:
        self.activations.labels(result=result).inc()

    def evaluated(self, pool: str) -> None:
        self.evaluations.labels(pool=pool).inc()

    def acted(self, pool: str, action: str) -> None:
        self.actions.labels(pool=pool, action=action).inc()
