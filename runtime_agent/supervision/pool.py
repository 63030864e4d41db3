"""The engine pool: the agent's set of engine owners, and the only place engines are created.

It turns an activation into a record and an owner, routes intents to the right owner, removes
owners whose engines stopped, and keeps the latest view of every engine for readers. It holds
no lock: the checks and inserts that must not interleave (one owner per model name, one port
and one IPC name per engine) run without an await between them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contract.names import ipc_name_for
from contract.phases import Phase
from contract.reasons import INSUFFICIENT_GPU, INVALID_ENGINE_CONFIG, TOO_LARGE
from registry.record import EngineRecord, EngineSpec, PerGpu
from runtime_agent.gpu.admission import Admit, Refuse
from runtime_agent.supervision.engine_kinds import gpus_needed, spec_problem
from runtime_agent.supervision.owner import EngineOwner, Intent, OwnerDeps
from runtime_agent.supervision.ports import choose_port, port_is_free
from runtime_agent.supervision.recovery import Step
from runtime_agent.supervision.views import EngineView, OpResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Activation:
    """What an activation asks for, whoever asked (the API builds it from its request)."""

    spec: EngineSpec
    port: int = 0  # 0: the pool picks one
    kv_limit_bytes: int | None = None
    per_gpu: PerGpu | None = None
    wait_seconds: float = 0.0  # wait this long for GPU memory instead of refusing at once


class EnginePool:
    def __init__(self, deps: OwnerDeps, is_port_free: Callable[[int], bool] = port_is_free):
        self._deps = deps
        self._settings = deps.settings
        self._is_port_free = is_port_free
        self.owners: dict[str, EngineOwner] = {}
        self._admitting: set[str] = set()  # names waiting for memory before they get an owner

    # ---- activation -----------------------------------------------------------------------

    async def activate(self, req: Activation) -> OpResult:
        spec = req.spec
        problem = self._spec_problem(spec)
        if problem is not None:
            return OpResult.error(400, problem, reason=INVALID_ENGINE_CONFIG)
        existing = self.owners.get(spec.model_name)
        if existing is not None:
            return await self._same_or_conflict(existing, spec, req.port, req.kv_limit_bytes)
        if spec.model_name in self._admitting:
            return OpResult.error(409, f"model {spec.model_name!r} is already being activated "
                                  "(waiting for GPU memory)", model_name=spec.model_name)
        clash = next((o for o in self.owners.values() if o.spec.ipc_name == spec.ipc_name), None)
        if clash is not None:
            return OpResult.error(409, f"ipc_name {spec.ipc_name!r} is already used by model "
                                  f"{clash.name!r}; pass a distinct ipc_name")
        port_or_error = self._pick_port(req.port)
        if isinstance(port_or_error, OpResult):
            return port_or_error
        admitted = await self._admit(spec, req)
        if isinstance(admitted, OpResult):
            return admitted
        if spec.model_name in self.owners:  # activated by a concurrent call while we waited
            self._deps.memory.release_claim(spec.model_name)
            return await self._same_or_conflict(self.owners[spec.model_name], spec, req.port,
                                                req.kv_limit_bytes)
        now = self._deps.clock()
        record = EngineRecord(engine_id=uuid.uuid4().hex, spec=spec, port=port_or_error,
                              phase=Phase.ACTIVATING.value, created_at=now, last_transition=now,
                              kv_limit_bytes=req.kv_limit_bytes, per_gpu=req.per_gpu,
                              devices=list(admitted.devices))
        owner = self._add(record, "spawn")
        try:  # a start that waits for its turn on a busy card answers while it waits
            error = await asyncio.wait_for(asyncio.shield(owner.spawned), 2.0)
        except TimeoutError:
            error = None
        if error is not None:
            return OpResult.error(500, error, model_name=spec.model_name, port=record.port,
                                  phase=owner.view.phase.value)
        return OpResult(200, self._activate_body(owner))

    async def _admit(self, spec: EngineSpec, req: Activation) -> Admit | OpResult:
        """Claim GPU memory for the new engine, waiting for it if the request says so."""
        memory = self._deps.memory
        need = req.per_gpu.need_bytes if req.per_gpu else 0
        n = gpus_needed(spec)
        self._admitting.add(spec.model_name)
        try:
            if req.wait_seconds > 0:
                result = await memory.claim_start_waiting(spec.model_name, need, n,
                                                          req.wait_seconds)
            else:
                result = memory.claim_start(spec.model_name, need, n)
        finally:
            self._admitting.discard(spec.model_name)
        if isinstance(result, Refuse):
            return refusal(result, spec.model_name)
        return result

    def _spec_problem(self, spec: EngineSpec) -> str | None:
        return spec_problem(self._settings, spec, len(self._deps.memory.ledger.devices) or 1)

    async def _same_or_conflict(self, owner: EngineOwner, spec: EngineSpec, port: int,
                                kv_limit: int | None) -> OpResult:
        diffs = [k for k, v in spec.model_dump().items() if getattr(owner.spec, k) != getattr(spec, k)
                 and not (k == "ipc_name" and spec.ipc_name == ipc_name_for(spec.model_name))]
        if port and port != owner.record.port:
            diffs.append("port")
        if diffs:
            return OpResult.error(
                409, f"model {spec.model_name!r} already runs with a different "
                f"{', '.join(diffs)}; deactivate it first to change them",
                model_name=spec.model_name, port=owner.record.port)
        await owner.spawned
        if kv_limit is not None and kv_limit != owner.record.kv_limit_bytes:
            await owner.request(Intent("kv_limit", limit_bytes=kv_limit))
        return OpResult(200, self._activate_body(owner))

    def _activate_body(self, owner: EngineOwner) -> dict[str, Any]:
        view = owner.view
        return {"status": "success", "model_name": owner.name, "port": view.port,
                "ipc_name": owner.spec.ipc_name, "phase": view.phase.value, "pid": view.pid,
                "engine_id": view.engine_id}

    def _pick_port(self, requested: int) -> int | OpResult:
        s = self._settings
        held = {o.record.port for o in self.owners.values()}
        if requested == 0:
            port = choose_port(s.port_low, s.port_high, held, self._is_port_free)
            if port is None:
                return OpResult.error(503, f"no free engine port in {s.port_low}-{s.port_high}")
            return port
        if not s.port_low <= requested <= s.port_high:
            return OpResult.error(400, f"port {requested} is outside the engine port range "
                                  f"{s.port_low}-{s.port_high}; pass 0 to let the agent pick")
        if requested in held or not self._is_port_free(requested):
            return OpResult.error(409, f"port {requested} is already in use")
        return requested

    def _add(self, record: EngineRecord, mode: str, pid: int | None = None) -> EngineOwner:
        owner = EngineOwner(record, self._deps)
        self.owners[record.spec.model_name] = owner
        owner.start(mode, pid)
        return owner

    # ---- intents --------------------------------------------------------------------------

    async def deactivate(self, model_name: str) -> OpResult:
        owner = self.owners.get(model_name)
        if owner is None:
            return OpResult(200, {"status": "success", "model_name": model_name,
                                  "message": "not running on this agent; nothing to do"})
        result = await owner.request(Intent("stop"))
        if self.owners.get(model_name) is owner and owner.view.phase is Phase.STOPPED:
            del self.owners[model_name]
        if result.status == 404:  # stopped by a concurrent deactivate: the same outcome
            return OpResult(200, {"status": "success", "model_name": model_name,
                                  "phase": Phase.STOPPED.value})
        return result

    async def lifecycle(self, model_name: str, intent: Intent,
                        wait_seconds: float = 0) -> OpResult:
        """Send an intent; a wake refused for want of GPU memory is retried, when the caller
        asked to wait, each time memory changes, until ``wait_seconds`` have passed."""
        owner = self.owners.get(model_name)
        if owner is None:
            return OpResult.error(404, f"model {model_name!r} is not running on this agent",
                                  model_name=model_name)
        deadline = time.monotonic() + wait_seconds
        while True:
            result = await owner.request(intent)
            left = deadline - time.monotonic()
            if result.body.get("reason") != INSUFFICIENT_GPU or left <= 0:
                return result
            await self._deps.memory.changed(left)

    # ---- reading --------------------------------------------------------------------------

    def views(self) -> list[EngineView]:
        return [o.view for o in self.owners.values()]

    async def close(self) -> None:
        """Stop supervising; engines keep running, to be re-adopted by the next agent."""
        await asyncio.gather(*(o.detach() for o in self.owners.values()))

    # ---- recovery -------------------------------------------------------------------------

    def adopt(self, steps: list[Step]) -> None:
        for step in steps:
            self._add(step.record, step.mode, step.pid)



def refusal(refused: Refuse, model_name: str) -> OpResult:
    """An admission refusal as the API returns it: what was needed, what is free, who holds it."""
    status = 400 if refused.reason == TOO_LARGE else 409
    return OpResult.error(status, f"{model_name!r} {refused.message}", reason=refused.reason,
                          model_name=model_name, needed_bytes=refused.needed,
                          free_bytes=refused.free,
                          holders=[{"model_name": k, "bytes": b} for k, b in refused.holders])
