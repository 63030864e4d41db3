"""The engine pool: the agent's set of engine owners, and the only place engines are created.

It turns an activation into a record and an owner, routes intents to the right owner, removes
owners whose engines stopped, and keeps the latest view of every engine for readers. It holds
no lock: the checks and inserts that must not interleave (one owner per model name, one port
and one IPC name per engine) run without an await between them. An IPC name is claimed on the
machine (``runtime_agent.kv.ownership``) before memory is admitted and before any engine starts,
so a name another process holds is refused with 409 and never written to. It answers with outcomes
(``runtime_agent.supervision.outcomes``); the API decides what they look like on the wire.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from msgspec import Struct, field
from msgspec.structs import asdict, replace

from contract.engines import lora_enabled
from contract.names import ipc_name_for
from contract.phases import Phase
from contract.reasons import (
    ENGINE_MISSING,
    INSUFFICIENT_GPU,
    INVALID_ENGINE_CONFIG,
    PORT_HELD,
    START_QUEUED,
    STOPPED_MEANWHILE,
)
from guard.redact import repr_without
from runtime_agent.gpu.admission import Admit, Refuse
from runtime_agent.kv.ownership import NameTaken, claim, holds, release
from runtime_agent.supervision.engine_kinds import (
    engine_missing,
    gpus_needed,
    spec_problem,
)
from runtime_agent.supervision.owner.answers import no_room
from runtime_agent.supervision.messages import (
    Intent,
    LoadAdapter,
    Revive,
    SetKvLimit,
    StartMode,
    Stop,
    UnloadAdapter,
    Wake,
)
from runtime_agent.supervision.outcomes import (
    Done,
    EngineFailed,
    NotFound,
    Outcome,
    Refusal,
    Refused,
)
from runtime_agent.supervision.owner import EngineOwner, OwnerDeps
from runtime_agent.supervision.ports import choose_port, port_is_free
from runtime_agent.supervision.recovery import Step
from runtime_agent.supervision.views import EngineView

if TYPE_CHECKING:
    from registry.record import EngineRecord, EngineSpec, PerGpu

log = logging.getLogger(__name__)


_ENDED = (Phase.STOPPING, Phase.STOPPED)
# What a start that answered before its process began waits for (the view's conditions).
_WAITS = {START_QUEUED: "queued: it waits for its turn on its GPUs (a start measured alone "
                        "is in progress there, or waits); the events feed says whose",
          "Staging": "queued: it waits for its weights in the weight cache",
          PORT_HELD: "queued: its port is held by another process; it starts once it is free"}


def _stopped_meanwhile(name: str) -> Refused:
    """A deactivate that came while this activation was starting the engine won: the
    callers raced (409), the engine did not fail (not a 502)."""
    return Refused(Refusal.CONFLICT, f"model {name!r} was deactivated by another request "
                   "while this activation was starting it; activate it again if it should run",
                   reason=STOPPED_MEANWHILE, model_name=name, phase=Phase.STOPPED)


class Activation(Struct, frozen=True):
    """What an activation asks for, whoever asked (the API builds it from its request)."""

    spec: EngineSpec
    port: int = 0  # 0: the pool picks one
    kv_limit_bytes: int | None = None
    per_gpu: PerGpu | None = None
    wait_seconds: float = 0.0  # wait this long for GPU memory instead of refusing at once
    credentials: dict[str, str] = field(default_factory=dict)  # the engine's env (no repr)

    def __repr__(self) -> str:
        return repr_without(self, ("credentials",))


class EnginePool:
    def __init__(self, deps: OwnerDeps, is_port_free: Callable[[int], bool] = port_is_free):
        self._deps = deps
        self._settings = deps.settings
        self._is_port_free = is_port_free
        self.owners: dict[str, EngineOwner] = {}
        self._admitting: set[str] = set()  # names waiting for memory before they get an owner
        self._claiming: dict[str, str] = {}  # ipc name -> engine id, claimed, not yet an owner
        # Owners whose record is not written yet: readers do not see them, since an agent
        # killed then forgets them (the activation is not answered: its caller asks again)
        self._unrecorded: set[str] = set()

    # ---- activation -----------------------------------------------------------------------

    async def activate(self, req: Activation) -> Outcome:
        spec = req.spec
        name = spec.model_name
        problem = self._spec_problem(spec)
        if problem is not None:
            return Refused(Refusal.INVALID, problem, INVALID_ENGINE_CONFIG, name)
        if name not in self.owners and (unwritable := self._deps.storage.refusal(name)):
            return unwritable  # a record that cannot be written must not start an engine
        existing = self.owners.get(name)
        if existing is not None:
            return await self._same_or_conflict(existing, spec, req.port, req.kv_limit_bytes)
        if (missing := engine_missing(self._settings, spec)) is not None:
            return Refused(Refusal.UNAVAILABLE, missing, ENGINE_MISSING, name)  # 503, not a 500
        if name in self._admitting:
            return Refused(Refusal.CONFLICT, f"model {name!r} is already being activated "
                           "(waiting for GPU memory)", model_name=name)
        clash = next((o.name for o in self.owners.values() if o.spec.ipc_name == spec.ipc_name),
                     None) or (spec.ipc_name in self._claiming and "being activated")
        if clash:
            return Refused(Refusal.CONFLICT, f"ipc_name {spec.ipc_name!r} is already used by "
                           f"model {clash!r}; pass a distinct ipc_name", model_name=name)
        port = self._pick_port(req.port, name)
        if isinstance(port, Refused):
            return port
        engine_id = uuid.uuid4().hex
        marker = self._claim(spec.ipc_name, engine_id)
        if isinstance(marker, str):
            return Refused(Refusal.CONFLICT, marker, model_name=name)
        self._claiming[spec.ipc_name] = engine_id
        try:
            admitted = await self._admit(spec, req)
        finally:
            del self._claiming[spec.ipc_name]
        if isinstance(admitted, Refused) or name in self.owners:
            release(spec.ipc_name, self._settings.kv_shm_dir, marker)
            if isinstance(admitted, Refused):
                return admitted
            self._deps.memory.release_claim(name)  # activated by a concurrent call meanwhile
            return await self._same_or_conflict(self.owners[name], spec, req.port,
                                                req.kv_limit_bytes)
        # imported here, not at start: its models load with the first engine (issue 26)
        from registry.record import EngineRecord

        now = self._deps.clock.wall()
        record = EngineRecord(engine_id=engine_id, spec=spec, port=port,
                              phase=Phase.ACTIVATING, created_at=now, last_transition=now,
                              kv_limit_bytes=req.kv_limit_bytes, per_gpu=req.per_gpu,
                              devices=list(admitted.devices), credentials=req.credentials,
                              kv_owner_inode=marker)
        owner = self._add(record, StartMode.SPAWN)
        self._unrecorded.add(name)  # until answered: its record is written before that
        owner.answered.add_done_callback(lambda _: self._recorded(owner))
        # Answered once the process started or the start waits (its turn on its cards, the
        # weight cache, its port): at once either way; a waiting start says why in the answer.
        error = await asyncio.shield(owner.answered)
        if owner.view.phase in _ENDED:
            return _stopped_meanwhile(name)
        if error is not None:
            return EngineFailed(name, error, owner.view.phase)
        return self._activated(owner)

    def _ours(self, engine_id: str) -> bool:
        return engine_id in self._claiming.values() or any(
            o.record.engine_id == engine_id for o in self.owners.values())

    def _claim(self, ipc_name: str, engine_id: str, segment_inode: int | None = None
               ) -> int | str:
        """Claim ``ipc_name`` on this machine: the marker's inode, or why it is another's.
        On the loop: a few tmpfs calls, and no await may come between check and insert."""
        try:
            return claim(ipc_name, self._settings.kv_shm_dir, str(self._settings.state_dir),
                         engine_id, self._ours, segment_inode)
        except NameTaken as exc:
            return str(exc)
        except OSError as exc:
            return f"ipc_name {ipc_name!r} cannot be claimed in {self._settings.kv_shm_dir}: {exc}"

    async def _admit(self, spec: EngineSpec, req: Activation) -> Admit | Refused:
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
            return no_room(result, f"{spec.model_name!r} {result.message}",
                           model_name=spec.model_name)
        return result

    def _spec_problem(self, spec: EngineSpec) -> str | None:
        return spec_problem(self._settings, spec, len(self._deps.memory.ledger.devices) or 1)

    async def _same_or_conflict(self, owner: EngineOwner, spec: EngineSpec, port: int,
                                kv_limit: int | None) -> Outcome:
        diffs = [k for k in spec.__struct_fields__ if getattr(owner.spec, k) != getattr(spec, k)
                 and not (k == "ipc_name" and spec.ipc_name == ipc_name_for(spec.model_name))]
        if port and port != owner.record.port:
            diffs.append("port")
        if diffs:
            return Refused(Refusal.CONFLICT, f"model {spec.model_name!r} already runs with a "
                           f"different {', '.join(diffs)}; deactivate it first to change them",
                           model_name=spec.model_name, details={"port": owner.record.port})
        await asyncio.shield(owner.answered)
        if owner.view.phase in _ENDED:
            return _stopped_meanwhile(spec.model_name)
        if owner.view.phase is Phase.FAILED:  # the same spec again: start it over
            revived = await owner.request(Revive())
            if not isinstance(revived, Done):
                return revived
            return Done(owner.name, owner.view.phase, True, details={
                **self._activated(owner).details, **revived.details})
        if kv_limit is not None and kv_limit != owner.record.kv_limit_bytes:
            await owner.request(SetKvLimit(kv_limit))
        return self._activated(owner, changed=False)

    def _activated(self, owner: EngineOwner, changed: bool = True) -> Done:
        view = owner.view
        details: dict[str, object] = {"port": view.port, "ipc_name": owner.spec.ipc_name,
                                      "pid": view.pid, "engine_id": view.engine_id}
        waiting = [c for c in view.conditions if c in _WAITS]
        if view.phase is Phase.ACTIVATING and waiting:  # queued: say for what
            details["reason"] = waiting[0]
            details["message"] = _WAITS[waiting[0]]
        return Done(owner.name, view.phase, changed, details=details)

    def _pick_port(self, requested: int, name: str) -> int | Refused:
        s = self._settings
        held = {o.record.port for o in self.owners.values()}
        if requested == 0:
            port = choose_port(s.port_low, s.port_high, held, self._is_port_free)
            if port is None:
                return Refused(Refusal.UNAVAILABLE, f"no free engine port in "
                               f"{s.port_low}-{s.port_high}", model_name=name)
            return port
        if not s.port_low <= requested <= s.port_high:
            return Refused(Refusal.INVALID, f"port {requested} is outside the engine port range "
                           f"{s.port_low}-{s.port_high}; pass 0 to let the agent pick",
                           model_name=name)
        if requested in held or not self._is_port_free(requested):
            return Refused(Refusal.CONFLICT, f"port {requested} is already in use",
                           model_name=name)
        return requested

    def _add(self, record: EngineRecord, mode: StartMode, pid: int | None = None) -> EngineOwner:
        owner = EngineOwner(record, self._deps)
        self.owners[record.spec.model_name] = owner
        owner.start(mode, pid)
        if mode is StartMode.STOP:  # a stop the previous agent left: made, then out of the pool
            owner.finished.add_done_callback(lambda _: self._forget(owner))
        return owner

    def _recorded(self, owner: EngineOwner) -> None:
        self._unrecorded.discard(owner.name)
        self._deps.on_view(owner.view)  # readers see it come: one more change

    def _forget(self, owner: EngineOwner) -> None:
        if self.owners.get(owner.name) is owner and owner.view.phase is Phase.STOPPED:
            del self.owners[owner.name]
            self._deps.on_view(owner.view)  # readers see it leave

    # ---- intents --------------------------------------------------------------------------

    async def deactivate(self, model_name: str) -> Outcome:
        owner = self.owners.get(model_name)
        if owner is None:
            return Done(model_name, None, changed=False, details={
                "message": "not running on this agent; nothing to do"})
        outcome = await owner.request(Stop())
        # leaving the pool changes what readers see after the STOPPED view did (the agent
        # renders its snapshot once per change): one more change
        self._forget(owner)
        if isinstance(outcome, NotFound):  # stopped by a concurrent deactivate: the same end
            return Done(model_name, Phase.STOPPED, changed=False)
        ref = owner.record.spec.claim_ref
        if isinstance(outcome, Done) and ref is not None and ref.name:
            # a claim that still asks for the model brings it back: say whose it is
            claim = f"{ref.namespace or 'default'}/{ref.name}"
            return replace(outcome, details={
                **outcome.details, "claim_ref": asdict(ref),
                "note": f"claim {claim} owns this engine: its reconciler starts it again while "
                        "the claim asks for it; delete or disable the claim to stop it"})
        return outcome

    async def lifecycle(self, model_name: str, intent: Intent,
                        wait_seconds: float = 0) -> Outcome:
        """Send an intent; a wake refused for want of GPU memory is retried, when the caller
        asked to wait, each time memory changes, until ``wait_seconds`` have passed."""
        owner = self.owners.get(model_name)
        if owner is None:
            return NotFound(model_name, f"model {model_name!r} is not running on this agent")
        clock = self._deps.clock
        deadline = clock.now() + wait_seconds
        while True:
            outcome = await owner.request(intent)
            left = deadline - clock.now()
            if (not isinstance(intent, Wake) or not isinstance(outcome, Refused)
                    or outcome.reason != INSUFFICIENT_GPU or left <= 0):
                return outcome
            await self._deps.memory.changed(left)

    # ---- LoRA adapters --------------------------------------------------------------------

    async def load_adapter(self, model_name: str | None, intent: LoadAdapter) -> Outcome:
        """Load an adapter into ``model_name``'s engine, or into the one engine started for
        LoRA when no model is named."""
        clash = next((o.name for o in self.owners.values() if o.name == intent.name
                      or (o.name != model_name and any(a.name == intent.name
                                                       for a in o.record.adapters))), None)
        if clash is not None:
            return Refused(Refusal.CONFLICT, f"the name {intent.name!r} is already served by "
                           f"{clash!r}; pick another lora_name", model_name=model_name)
        if model_name is None:
            able = [o for o in self.owners.values() if lora_enabled(o.spec.engine, o.spec.args)]
            if len(able) != 1:
                which = ", ".join(sorted(o.name for o in able)) or "none"
                return Refused(Refusal.INVALID, f"name the base model in model_name: models "
                               f"started for LoRA adapters here: {which}")
            model_name = able[0].name
        return await self.lifecycle(model_name, intent)

    async def unload_adapter(self, model_name: str | None, intent: UnloadAdapter) -> Outcome:
        holder = self.owners.get(model_name) if model_name else next(
            (o for o in self.owners.values() if any(a.name == intent.name
                                                    for a in o.record.adapters)), None)
        if holder is None:
            return Done(model_name or "", None, changed=False, details={
                "lora_name": intent.name, "message": "no such adapter here; nothing to do"})
        return await holder.request(intent)

    # ---- reading --------------------------------------------------------------------------

    def views(self) -> list[EngineView]:
        """What readers see: every owner but those whose record is not written yet."""
        return [o.view for name, o in self.owners.items() if name not in self._unrecorded]

    def view_of(self, model_name: str) -> EngineView | None:
        owner = self.owners.get(model_name)
        return owner.view if owner is not None else None

    async def close(self) -> None:
        """Stop supervising; engines keep running, to be re-adopted by the next agent."""
        await asyncio.gather(*(o.detach() for o in self.owners.values()))

    # ---- recovery -------------------------------------------------------------------------

    def adopt(self, steps: list[Step]) -> None:
        """Supervise what the recovery found. A record from before claims, or one whose claim
        marker is gone, claims its name now, proving the segment by the inode it recorded;
        one whose name another holds keeps running, its segment left alone (``KvKeeper``)."""
        for step in steps:
            record = step.record
            if not holds(record.spec.ipc_name, self._settings.kv_shm_dir,
                         record.kv_owner_inode, record.engine_id) \
                    or record.kv_owner_inode is None:
                marker = self._claim(record.spec.ipc_name, record.engine_id, record.kv_inode)
                if isinstance(marker, str):
                    log.warning("%s: %s", record.spec.model_name, marker)
                    record.kv_owner_inode = -1  # never an inode: held by no one here
                else:
                    record.kv_owner_inode = marker
            self._add(record, step.mode, step.pid)
