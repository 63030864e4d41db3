"""The snapshot and the short model list: JSON built from the owners' immutable views.

Building it touches no engine, no disk and no GPU: every figure was gathered before the request
(request figures by each owner's scrape loop), so a snapshot costs the same with one engine
busy for ten seconds as with all idle. The one exception is asked for by name:
``?fresh=requests`` (``runtime_agent.api.fresh``) reads the request figures first.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from typing import Any

import msgspec

from contract.phases import Phase
from runtime_agent.gpu.broker import EngineHbm, MemoryBroker
from runtime_agent.kv.hold import capped_by, in_force
from runtime_agent.supervision.views import EngineView


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def model_entry(view: EngineView) -> dict[str, Any]:
    """One engine as the AIBrix controller decodes it (``shared/aibrix-wire.md``), plus ours.

    Whole numbers are ints in every phase (Go refuses ``0.0`` for an int64); a figure that was
    not observed is null (a counter) or 0 with ``request_metrics_observed: false`` (the gauges
    the controller takes as int64)."""
    spec = view.spec
    return {
        "model_name": spec.model_name,
        "engine": spec.engine,
        "simulated": view.simulated,  # the simulator runs in place of the engine (no model)
        "artifact_url": spec.artifact_url,
        "claim_ref": msgspec.to_builtins(spec.claim_ref),
        "engine_id": view.engine_id,
        "port": view.port,
        "ipc_name": spec.ipc_name,
        "pid": view.pid,
        "phase": view.phase.value,
        "alive": view.alive,
        "ready": view.ready,
        "adopted": view.adopted,
        "desired": view.desired,
        "sleep_level": view.sleep_level,
        "operation": view.operation,
        "restart_count": view.restart_count,
        "last_error": view.last_error,
        "last_exit": view.last_exit,
        "last_transition": _iso(view.last_transition) if view.last_transition else None,
        **request_fields(view),
        "observed_footprint_bytes": view.observed_footprint_bytes,
        "context_length": view.context_length,
        "kv_limit_requested_bytes": view.kv.requested,
        "kv_limit_applied_bytes": view.kv.applied,
        "kv_limit_capped_by": capped_by(view.kv),
        # The limit in force, as AIBrix's controller compares it with its target: the
        # segment's total_size, or a limit above the startup capacity once all of it is held.
        "kv_capacity_bytes": in_force(view.kv),
        # What the engine created its segment with: the most a limit can be.
        "kv_startup_capacity_bytes": view.kv.capacity,
        "kv_total_bytes": view.kv.total,
        "kv_used_bytes": view.kv.used,
        "kv_segment": {"name": spec.ipc_name, "present": view.kv.present},
        "kv_limit_set_back_total": view.kv.set_back_total,
        "conditions": list(view.conditions),
        "staging": view.staging.as_dict() if view.staging else None,
        "engine_args": dict(spec.args),
        "lora_adapters": [{"name": n, "path": p, "loaded": loaded} for n, p, loaded in view.adapters],
        "log_path": view.log_path,
    }


def request_fields(view: EngineView) -> dict[str, Any]:
    """The request figures of one entry: the gauges 0 and the counter null when not observed."""
    observed = request_figures_observed(view)
    return {
        "request_metrics_observed": observed,
        "requests_running": view.requests_running if observed else 0,
        "requests_waiting": view.requests_waiting if observed else 0,
        "request_success_total": view.request_success_total if observed else None,
        "request_figures_at": _iso(view.figures_at) if view.figures_at else None,
    }


def request_figures_observed(view: EngineView) -> bool:
    """Request figures count only while the engine is active, from a scrape since it became so.

    AIBrix's sidecar reads them only for an active engine (its e2e test expects ``false`` for a
    sleeping one); a sleeping, booting or restarting engine's last figures are history, and the
    pool policy must not judge an engine's idleness by them."""
    return (view.phase is Phase.ACTIVE and view.figures_at is not None
            and view.figures_at >= view.last_transition
            and view.requests_running is not None and view.requests_waiting is not None
            and view.request_success_total is not None)


def short_entry(view: EngineView) -> dict[str, Any]:
    """One entry of ``GET /v1/runtime/models`` (AIBrix's ModelInfo, plus ours)."""
    entry: dict[str, Any] = {
        "model_name": view.spec.model_name, "engine": view.spec.engine,
        "simulated": view.simulated, "port": view.port,
        "ipc_name": view.spec.ipc_name, "phase": view.phase.value, "ready": view.ready,
        "pid": view.pid, "restart_count": view.restart_count}
    if view.kv.used is not None:
        entry["kv_used_bytes"] = view.kv.used
    if view.kv.total is not None:
        entry["kv_total_bytes"] = view.kv.total
    return entry


def memory_entry(figures: EngineHbm | None, view: EngineView) -> dict[str, Any]:
    f = figures or EngineHbm()
    return {"hbm_bytes": f.hbm_bytes, "hbm_peak_bytes": f.hbm_peak_bytes,
            "sleeping_footprint_bytes": f.sleeping_footprint_bytes,
            "host_rss_bytes": f.host_rss_bytes, "devices": list(view.devices)}


def build_snapshot(views: list[EngineView], cached_artifacts: list[str],
                   agent: dict[str, Any], memory: MemoryBroker) -> dict[str, Any]:
    ordered = sorted(views, key=lambda v: v.spec.model_name)
    return {
        "observed_at": _iso(time.time()),
        "agent": {**agent, "pid": os.getpid()},
        "node": memory.node(),
        "accelerators": memory.accelerators(),
        "models": [{**model_entry(v), **memory_entry(memory.figures.get(v.spec.model_name), v)}
                   for v in ordered],
        "cached_artifacts": cached_artifacts,
    }
