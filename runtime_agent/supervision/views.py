"""Immutable values that owners hand to readers: engine views and transition events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from msgspec import Struct, field

from contract.phases import Phase
from runtime_agent.kv.hold import KvState

if TYPE_CHECKING:
    from registry.record import EngineSpec
    from runtime_agent.artifacts.staging import StagingView


class EngineView(Struct, frozen=True):
    """What one engine looks like right now; replaced (never changed) on every change."""

    engine_id: str
    spec: EngineSpec
    port: int
    phase: Phase
    pid: int | None
    alive: bool
    ready: bool
    adopted: bool
    desired: str
    sleep_level: int | None
    operation: str | None
    restart_count: int
    last_error: str | None  # what is wrong now; None once the engine is ready again
    last_transition: float
    created_at: float
    requests_running: int | None
    requests_waiting: int | None
    request_success_total: int | None
    figures_at: float | None
    log_path: str
    op_counts: dict[str, int] = field(default_factory=dict)
    budget_exhausted: int = 0
    kv: KvState = field(default_factory=KvState)
    devices: tuple[int, ...] = ()
    observed_footprint_bytes: int | None = None
    context_length: int | None = None
    adapters: tuple[tuple[str, str, bool], ...] = ()  # LoRA: (name, path, loaded now)
    conditions: tuple[str, ...] = ()  # what is wrong now (contract reason names)
    staging: StagingView | None = None  # weights being staged before the start (issue 14)
    last_exit: str | None = None  # how the process last ended unasked, with its log tail
    simulated: bool = False  # the process is the simulator (python -m engines.sim), not the engine


class EngineEvent(Struct, frozen=True):
    """One thing that happened to an engine (a phase transition or a notable act)."""

    at: float
    model_name: str
    engine_id: str
    src: str
    dst: str
    reason: str
    message: str
    duration_s: float | None = None  # for finished operations (sleep, wake)

    def as_dict(self) -> dict[str, Any]:
        return {"ts": self.at, "model": self.model_name, "engine_id": self.engine_id,
                "from": self.src, "to": self.dst, "reason": self.reason, "message": self.message}
