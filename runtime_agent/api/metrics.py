"""Prometheus metrics with the published agent's names, read from current state at scrape time.

A scrape builds every family from the owners' immutable views and the agent's own counters: it
never calls NVML, an engine or the disk. Counters that the registry keeps (restart attempts,
lifecycle operations, budget exhaustion) come from the engine records, so a dashboard does not
drop to zero when the agent restarts. Operation durations are a live histogram, fed by events.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from contract.phases import Phase
from runtime_agent.supervision.views import EngineEvent, EngineView

P = "aibrix:modelclaim_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_OP_REASONS = {"Slept": ("sleep", "success"), "Woken": ("wake", "success"),
               "SleepFailed": ("sleep", "failure"), "WakeFailed": ("wake", "failure")}


class AgentCollector(Collector):
    def __init__(self, views: Callable[[], list[EngineView]],
                 extra: Callable[[], Iterable[Metric]] | None = None) -> None:
        self._views = views
        self._extra = extra
        self.readoptions: Tally[str] = Tally()

    def collect(self) -> Iterator[Metric]:
        views = self._views()
        resident = GaugeMetricFamily(P + "models_resident",
                                     "Engines whose process runs in this Pod.")
        resident.add_metric([], sum(1 for v in views if v.alive))
        yield resident
        state = GaugeMetricFamily(P + "engine_state", "Engines in each phase.", labels=["phase"])
        phases = Tally(v.phase for v in views)
        for phase in Phase:
            state.add_metric([phase.value], phases.get(phase, 0))
        yield state
        yield engine_info(views)
        restarts = CounterMetricFamily(P + "engine_restart_attempts",
                                       "Restarts of each engine over its life.", labels=["model"])
        exhausted = CounterMetricFamily(P + "engine_restart_budget_exhausted",
                                        "Times an engine spent its restart budget.",
                                        labels=["model"])
        ops = CounterMetricFamily(P + "lifecycle_operations", "Sleep and wake operations.",
                                  labels=["model", "action", "result"])
        for v in views:
            name = v.spec.model_name
            restarts.add_metric([name], v.restart_count)
            exhausted.add_metric([name], v.budget_exhausted)
            for key, count in sorted(v.op_counts.items()):
                action, _, result = key.partition(":")
                if action != "kv_limit":
                    ops.add_metric([name, action, result], count)
        yield restarts
        yield exhausted
        yield ops
        yield from _kv_families(views)
        readopt = CounterMetricFamily(P + "engine_re_adoptions",
                                      "Engines found at agent start, by what became of them.",
                                      labels=["result"])
        for result in ("adopted", "rebuilt", "restarted", "failed", "stopped"):
            readopt.add_metric([result], self.readoptions.get(result, 0))
        yield readopt
        if self._extra is not None:
            yield from self._extra()


def engine_info(views: list[EngineView]) -> Metric:
    """One series per engine saying what it is: its kind and whether the simulator runs in its
    place (``simulated="true"``: no model runs, its figures are made up)."""
    info = GaugeMetricFamily(P + "engine_info", "Each engine's kind, and whether it is the "
                             "simulator (simulated=\"true\") rather than the real engine.",
                             labels=["model", "engine", "simulated"])
    for v in views:
        info.add_metric([v.spec.model_name, v.spec.engine, str(v.simulated).lower()], 1)
    return info


def _kv_families(views: list[EngineView]) -> Iterator[Metric]:
    picks: tuple[tuple[str, str, Callable[[EngineView], int | None]], ...] = (
        ("kv_used_bytes", "KV cache mapped by the engine (used + prealloc).",
         lambda v: v.kv.used),
        ("kv_total_bytes", "KV-cache limit in force in the engine's segment.",
         lambda v: v.kv.total),
        ("kv_limit_requested_bytes", "KV-cache limit asked of the agent.",
         lambda v: v.kv.requested),
        ("kv_limit_applied_bytes", "KV-cache limit confirmed by read-back.",
         lambda v: v.kv.applied),
    )
    for name, doc, pick in picks:
        rows = [([v.spec.model_name], pick(v)) for v in views]
        yield gauge(name, doc, ["model"], ((labels, val) for labels, val in rows
                                           if val is not None))
    ops = CounterMetricFamily(P + "kv_limit_operations", "KV-limit writes by result.",
                              labels=["model", "result"])
    for v in views:
        for key, count in sorted(v.op_counts.items()):
            action, _, result = key.partition(":")
            if action == "kv_limit":
                ops.add_metric([v.spec.model_name, result], count)
    yield ops


class AgentMetrics:
    """The agent's own metrics registry (never the global one)."""

    def __init__(self, views: Callable[[], list[EngineView]],
                 extra: Callable[[], Iterable[Metric]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = AgentCollector(views, extra)
        self.registry.register(self.collector)
        # The sidecar's labels (model, action, result): AIBrix's runtime dashboard filters this
        # family by model and groups it by model, pod, action and result.
        self.durations = Histogram(P + "lifecycle_operation_duration_seconds",
                                   "How long sleep and wake calls took.",
                                   ["model", "action", "result"],
                                   buckets=DURATION_BUCKETS, registry=self.registry)
        self._timed: set[tuple[str, str, str]] = set()

    def on_event(self, event: EngineEvent) -> None:
        op = _OP_REASONS.get(event.reason)
        if op is not None and event.duration_s is not None:
            key = (event.model_name, *op)
            self.durations.labels(*key).observe(event.duration_s)
            self._timed.add(key)
        elif event.dst == Phase.STOPPED.value:  # gone: its series go with it, as its counters do
            for key in [k for k in self._timed if k[0] == event.model_name]:
                self.durations.remove(*key)
                self._timed.discard(key)

    def count_readoptions(self, modes: Iterable[str]) -> None:
        self.collector.readoptions.update(modes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def gauge(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], Any]]
          ) -> GaugeMetricFamily:
    family = GaugeMetricFamily(P + name, doc, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


def memory_families(agent: Any) -> Iterator[Metric]:
    """GPU and host memory figures from the memory broker's last sample (no NVML call)."""
    memory = agent.memory
    views = agent.pool.views()
    figures = {v.spec.model_name: memory.figures.get(v.spec.model_name) for v in views}
    yield gauge("hbm_peak_bytes", "Peak GPU memory of each engine since its process started.",
                ["model"], (([k], f.hbm_peak_bytes) for k, f in figures.items()
                            if f is not None and f.hbm_peak_bytes is not None))
    yield gauge("hbm_bytes", "GPU memory each engine holds now.", ["model"],
                (([k], f.hbm_bytes) for k, f in figures.items()
                 if f is not None and f.hbm_bytes is not None))
    yield gauge("sleeping_footprint_bytes", "GPU memory a sleeping engine still holds.",
                ["model"], (([k], f.sleeping_footprint_bytes) for k, f in figures.items()
                            if f is not None and f.sleeping_footprint_bytes is not None))
    yield gauge("host_rss_bytes", "Host memory of each engine's whole process tree.", ["model"],
                (([k], f.host_rss_bytes) for k, f in figures.items()
                 if f is not None and f.host_rss_bytes is not None))
    accelerators = memory.accelerators()
    for name, key, doc in (
        ("device_hbm_total_bytes", "hbm_total_bytes", "GPU memory of each card."),
        ("device_hbm_free_bytes", "hbm_free_bytes", "Free GPU memory of each card."),
        ("device_hbm_reserved_bytes", "hbm_reserved_bytes",
         "GPU memory claimed by starts and wakes not yet measured."),
        ("device_hbm_used_by_engines_bytes", "hbm_used_by_engines_bytes",
         "GPU memory attributed to engines."),
    ):
        yield gauge(name, doc, ["device", "uuid"],
                    (([str(a["index"]), a["id"]], a[key]) for a in accelerators))
    node = memory.node()
    yield gauge("host_memory_total_bytes", "Host memory of the node.", [],
                [([], node["host_memory_total_bytes"])])
    yield gauge("host_memory_available_bytes", "Host memory available on the node.", [],
                [([], node["host_memory_available_bytes"])])
    samples = CounterMetricFamily(P + "gpu_samples", "GPU memory samples taken.")
    samples.add_metric([], memory.samples_total)
    yield samples
    cost = CounterMetricFamily(P + "gpu_sample_seconds", "Time spent taking GPU samples.")
    cost.add_metric([], memory.sample_seconds_total)
    yield cost
