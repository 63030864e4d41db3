"""What readers see of one engine: its view, built from the record and the owner's parts.

A pure function: the loop calls it on every change and publishes the value when it differs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgspec import Struct

from contract.reasons import (
    ENGINE_UNRESPONSIVE,
    KV_LIMIT_NOT_HELD,
    KV_SEGMENT_MISSING,
    PORT_HELD,
    START_QUEUED,
    STORAGE_UNAVAILABLE,
)
from engines.driver import Observation
from runtime_agent.kv.hold import KvState
from runtime_agent.supervision.views import EngineView

if TYPE_CHECKING:
    from registry.record import EngineRecord
    from runtime_agent.artifacts.staging import StagingView


class Seen(Struct, frozen=True):
    """What the owner's parts know beyond the record, at the moment of a view."""

    alive: bool
    ready: bool
    adopted: bool
    operation: str | None
    figures: Observation | None
    figures_at: float | None
    kv: KvState
    loaded: frozenset[str]
    staging: StagingView | None
    storage_failing: bool
    port_held: bool
    queued: bool
    unresponsive: bool
    log_path: str
    simulated: bool


def make_view(r: EngineRecord, seen: Seen) -> EngineView:
    f = seen.figures
    return EngineView(
        engine_id=r.engine_id, spec=r.spec, port=r.port, phase=r.phase, pid=r.pid,
        alive=seen.alive, ready=seen.ready, adopted=seen.adopted, desired=r.desired,
        sleep_level=r.sleep_level, operation=seen.operation, restart_count=r.restart_count,
        last_error=r.last_error, last_transition=r.last_transition, created_at=r.created_at,
        requests_running=f.running if f else None, requests_waiting=f.waiting if f else None,
        request_success_total=f.success_total if f else None, figures_at=seen.figures_at,
        observed_footprint_bytes=f.footprint_bytes if f else None,
        context_length=f.context_length if f else None,
        log_path=seen.log_path, op_counts=dict(r.op_counts),
        budget_exhausted=r.budget_exhausted, kv=seen.kv, devices=tuple(r.devices),
        adapters=tuple((a.name, a.path, a.name in seen.loaded) for a in r.adapters),
        staging=seen.staging, conditions=conditions(seen), last_exit=r.last_exit,
        simulated=seen.simulated,
    )


def conditions(seen: Seen) -> tuple[str, ...]:
    """What is wrong now, by the contract's reason names."""
    found = []
    if seen.kv.not_held:
        found.append(KV_LIMIT_NOT_HELD)
    if seen.kv.lost and seen.alive:
        found.append(KV_SEGMENT_MISSING)
    if seen.unresponsive:
        found.append(ENGINE_UNRESPONSIVE)
    if seen.storage_failing:
        found.append(STORAGE_UNAVAILABLE)
    if seen.port_held:
        found.append(PORT_HELD)
    if seen.queued:
        found.append(START_QUEUED)
    if seen.staging is not None:
        found.append("Staging")
    return tuple(found)
