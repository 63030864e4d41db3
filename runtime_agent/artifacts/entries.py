"""Cache entries as the API, the events feed and the metrics see them.

An entry is mutable, owned by the cache, and changed only on the event loop (its byte counter
by the download's thread). Everything here reads entries and builds plain data: list items,
events, Prometheus families.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from runtime_agent.artifacts.manifest import Manifest
from runtime_agent.artifacts.planning import Rate, eta_s
from runtime_agent.artifacts.urls import ArtifactRef
from runtime_agent.artifacts.verify import Progress

P = "aibrix:modelclaim_artifact_"


class EntryState(StrEnum):
    DOWNLOADING = "downloading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class Job:
    """A download in flight: its task, its stop switch, and the bytes it promised to write."""

    task: asyncio.Task[None]
    cancelled: threading.Event
    need: int = 0
    base: int = 0  # bytes on disk when it started, counted in the progress

    def remaining(self, progress: Progress) -> int:
        return max(0, self.need - max(0, progress.done - self.base))


@dataclass
class Entry:
    ref: ArtifactRef
    state: EntryState
    progress: Progress = field(default_factory=Progress)
    manifest: Manifest | None = None
    error: str | None = None
    reason: str | None = None
    rate: Rate | None = None
    started_at: float | None = None
    resumable: bool = True  # a POST (or a restart) can go on from the bytes on disk
    job: Job | None = None

    @property
    def entry_id(self) -> str:
        return self.ref.entry_id

    def item(self, path: str | None, in_use: bool) -> dict[str, Any]:
        """One entry as ``GET /v1/model/list`` shows it."""
        m = self.manifest
        total = m.total_bytes if m else self.progress.total
        done = total if self.state is EntryState.READY else self.progress.done
        rate = self.rate.per_s if self.rate and self.state is EntryState.DOWNLOADING else None
        return {
            "artifact_id": self.entry_id, "artifact_url": self.ref.url,
            "source": self.ref.kind.value,
            "revision": self.ref.revision,
            "resolved_revision": m.resolved_revision if m else None,
            "state": self.state.value, "bytes_done": done, "bytes_total": total,
            "rate_bytes_per_second": round(rate) if rate is not None else None,
            "eta_seconds": _eta(rate, done, total) if self.state is EntryState.DOWNLOADING
            else None,
            "files": len(m.files) if m else None, "verified": list(m.verified) if m else [],
            "local_path": path, "in_use": in_use,
            "staged_at": m.staged_at if m else None, "last_used_at": m.last_used_at if m else None,
            "started_at": self.started_at, "error": self.error, "reason": self.reason,
            "resumable": self.resumable if self.state is EntryState.FAILED else None,
        }


def _eta(rate: float | None, done: int, total: int) -> int | None:
    left = eta_s(rate, done, total)
    return round(left) if left is not None else None


@dataclass(frozen=True)
class ArtifactEvent:
    """One thing that happened to an entry, for the agent's events feed."""

    at: float
    entry_id: str
    artifact_url: str
    src: str
    dst: str
    reason: str
    message: str
    bytes_done: int = 0
    bytes_total: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"ts": self.at, "kind": "artifact", "model": "", "artifact_id": self.entry_id,
                "artifact_url": self.artifact_url, "from": self.src, "to": self.dst,
                "reason": self.reason, "message": self.message, "bytes_done": self.bytes_done,
                "bytes_total": self.bytes_total}


@dataclass
class Tallies:
    """Counters since the agent started."""

    completed: int = 0
    failed: int = 0
    evicted: int = 0
    bytes_fetched: int = 0


def metric_families(entries: Iterable[Entry], tallies: Tallies) -> Iterator[Metric]:
    entries = list(entries)
    states = GaugeMetricFamily(P + "entries", "Weight-cache entries in each state.",
                               labels=["state"])
    for state in EntryState:
        states.add_metric([state.value], sum(1 for e in entries if e.state is state))
    yield states
    ready = GaugeMetricFamily(P + "ready_bytes", "Bytes of the ready entries on disk.")
    ready.add_metric([], sum(e.manifest.total_bytes for e in entries if e.manifest))
    yield ready
    done = GaugeMetricFamily(P + "download_bytes_done", "Bytes a download has on disk.",
                             labels=["artifact"])
    total = GaugeMetricFamily(P + "download_bytes_total", "Bytes a download will have.",
                              labels=["artifact"])
    rate = GaugeMetricFamily(P + "download_rate_bytes_per_second",
                             "Recent speed of a download.", labels=["artifact"])
    for e in entries:
        if e.state is EntryState.DOWNLOADING:
            done.add_metric([e.ref.url], e.progress.done)
            total.add_metric([e.ref.url], e.progress.total)
            rate.add_metric([e.ref.url], e.rate.per_s or 0.0 if e.rate else 0.0)
    yield done
    yield total
    yield rate
    results = CounterMetricFamily(P + "downloads", "Downloads that ended, by result.",
                                  labels=["result"])
    results.add_metric(["completed"], tallies.completed)
    results.add_metric(["failed"], tallies.failed)
    yield results
    evicted = CounterMetricFamily(P + "evictions", "Entries evicted to make room.")
    evicted.add_metric([], tallies.evicted)
    yield evicted
    fetched = CounterMetricFamily(P + "fetched_bytes", "Bytes written by completed downloads.")
    fetched.add_metric([], tallies.bytes_fetched)
    yield fetched
