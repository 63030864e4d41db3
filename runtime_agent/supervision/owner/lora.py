"""LoRA adapters of one engine: loaded at run time, kept in the record, never lost to a restart.

Called only from inside the owner's task. An adapter is desired state: it is written to the
durable record first, then loaded into the engine by a helper task (the owner keeps answering
meanwhile; a sleep or wake waits for it, as they wait for each other: the ``OperationSlot``).
An engine that is not awake gets its adapters when it is. After every start the owner loads the
record's adapters again, and after a re-adoption it asks the engine which ones it serves and
loads the missing ones, so an agent or engine restart loses none. ``Lora`` keeps the set of
adapters the current process serves (cleared when the process changes) and decides: each
request and each call's end becomes a ``Plan`` (the record's adapters to write, events to
tell, the answer, the engine call to make), which ``carry_out`` makes through ``OwnerLoop``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from msgspec import Struct

from contract.engines import adapter_name_problem, lora_enabled
from contract.phases import Phase
from engines.driver import EngineDriver
from engines.client import EngineCallError
from runtime_agent.settings import Settings
from runtime_agent.supervision.durability import StorageHealth
from runtime_agent.supervision.messages import (
    Action,
    AdapterDone,
    AdaptersSynced,
    LoadAdapter,
    Request,
    UnloadAdapter,
)
from runtime_agent.supervision.outcomes import EngineFailed, Outcome, Refusal, Refused
from runtime_agent.supervision.owner.answers import done, resolve
from runtime_agent.supervision.owner.port import OwnerLoop
from runtime_agent.supervision.owner.slots import OperationSlot, ProcessSlot

if TYPE_CHECKING:
    from registry.record import LoraAdapter


class Call(Struct, frozen=True):
    """An engine call to make as the operation in flight."""

    action: Action
    name: str
    path: str


class Plan(Struct, frozen=True):
    """What a LoRA decision comes to, made in this order by ``carry_out``."""

    adapters: list[LoraAdapter] | None = None  # the record's adapters become these, written
    events: tuple[tuple[str, str], ...] = ()  # (reason, message) to tell
    answer: Outcome | None = None  # the request's answer
    call: Call | None = None  # then this call runs (the request waits for its end)


class Lora:
    def __init__(self, loop: OwnerLoop, ops: OperationSlot, procs: ProcessSlot,
                 engine: EngineDriver, storage: StorageHealth, settings: Settings) -> None:
        self._loop, self._ops, self._procs = loop, ops, procs
        self._engine, self._storage, self._settings = engine, storage, settings
        self._loaded: set[str] = set()  # the adapters the current process serves

    def serves(self, name: str) -> bool:
        return name in self._loaded

    def new_process(self) -> None:
        """A new process, or none: it serves no adapter yet."""
        self._loaded = set()

    async def on_load(self, request: Request, intent: LoadAdapter) -> None:
        await self.carry_out(self.plan_load(intent), request)

    async def on_unload(self, request: Request, intent: UnloadAdapter) -> None:
        await self.carry_out(self.plan_unload(intent), request)

    async def on_done(self, finished: AdapterDone) -> None:
        self._ops.finish()
        await self.carry_out(self.plan_done(finished), finished.request)

    async def carry_out(self, plan: Plan, request: Request | None) -> None:
        loop = self._loop
        if plan.adapters is not None:
            loop.record.adapters = plan.adapters
            await loop.persist()  # durable first: a restart loads it even if the call fails
        for reason, message in plan.events:
            loop.emit(reason, message)
        if plan.answer is not None and request is not None:
            resolve(request.reply, plan.answer)
        if plan.call is not None:
            self._start(plan.call, request)

    def plan_load(self, intent: LoadAdapter) -> Plan:
        loop = self._loop
        spec, name, phase = loop.record.spec, loop.name, loop.phase
        if (problem := adapter_name_problem(intent.name)) is not None:
            return Plan(answer=self._refused(intent, Refusal.INVALID, problem))
        if not lora_enabled(spec.engine, spec.args):
            return Plan(answer=self._refused(
                intent, Refusal.INVALID, f"model {name!r} was not started for LoRA adapters; "
                "activate it with engine_config.args {\"--enable-lora\": \"\"}"))
        if (unwritable := self._storage.refusal(name)) is not None:
            return Plan(answer=unwritable)
        adapters = loop.record.adapters
        known = next((a for a in adapters if a.name == intent.name), None)
        if known is not None and known.path != intent.path:
            return Plan(answer=self._refused(
                intent, Refusal.CONFLICT, f"adapter {intent.name!r} is already loaded from "
                f"{known.path!r}; unload it first to load it from elsewhere"))
        if known is not None and intent.name in self._loaded:
            return Plan(answer=done(name, phase, intent, changed=False,
                                    details=self._details(intent.name, True, adapters)))
        from registry.record import LoraAdapter  # loaded with the first engine, not at start

        wanted = adapters if known is not None else [*adapters, LoraAdapter(
            name=intent.name, path=intent.path, artifact_url=intent.artifact_url)]
        written = None if known is not None else wanted
        if phase is not Phase.ACTIVE:
            return Plan(adapters=written, answer=done(name, phase, intent, details={
                **self._details(intent.name, False, wanted), "in_force": False,
                "message": f"loaded when {name!r} is awake and ready"}))
        return Plan(adapters=written, call=Call(Action.LOAD_ADAPTER, intent.name, intent.path))

    def plan_unload(self, intent: UnloadAdapter) -> Plan:
        loop = self._loop
        adapters = loop.record.adapters
        if not any(a.name == intent.name for a in adapters):
            return Plan(answer=done(loop.name, loop.phase, intent, changed=False, details={
                "lora_name": intent.name, "message": "no such adapter; nothing to do"}))
        wanted = [a for a in adapters if a.name != intent.name]
        if intent.name not in self._loaded or self._procs.proc is None:
            self._loaded.discard(intent.name)
            return Plan(adapters=wanted, answer=done(
                loop.name, loop.phase, intent, details=self._details(intent.name, False, wanted)))
        return Plan(adapters=wanted, call=Call(Action.UNLOAD_ADAPTER, intent.name, ""))

    def plan_done(self, finished: AdapterDone) -> Plan:
        loop = self._loop
        loading = finished.action is Action.LOAD_ADAPTER
        gone = finished.error is not None and finished.status == 404 and not loading
        answer: Outcome | None = None
        if finished.error is None or gone:
            if loading:
                self._loaded.add(finished.name)
            else:
                self._loaded.discard(finished.name)
            if finished.request is not None:
                answer = done(loop.name, loop.phase, finished.request.intent,
                              details=self._details(finished.name, loading,
                                                    loop.record.adapters))
            return Plan(events=(("AdapterLoaded" if loading else "AdapterUnloaded",
                                 finished.name),), answer=answer)
        if finished.request is not None:
            answer = self._engine_refusal(finished)
        kept = ([a for a in loop.record.adapters if a.name != finished.name] if loading
                else None)  # a load the engine refused: it is not desired any more
        return Plan(adapters=kept, events=(("AdapterLoadFailed" if loading
                                            else "AdapterUnloadFailed",
                                            f"{finished.name}: {finished.error}"),),
                    answer=answer)

    def _start(self, call: Call, request: Request | None) -> None:
        loop, engine = self._loop, self._engine
        gen, timeout = loop.generation, self._settings.lifecycle_timeout_s
        action, name, path = call.action, call.name, call.path

        async def run() -> None:
            error, status = None, None
            try:
                if action is Action.LOAD_ADAPTER:
                    await engine.load_adapter(name, path, timeout)
                else:
                    await engine.unload_adapter(name, timeout)
            except EngineCallError as exc:
                error, status = str(exc), exc.status
            loop.post(AdapterDone(gen, action, name, error, status, request))

        self._ops.start(asyncio.create_task(run(), name=f"{action.value}:{loop.name}"),
                        action.value, request)
        loop.publish()

    def _refused(self, intent: LoadAdapter, kind: Refusal, message: str) -> Refused:
        return Refused(kind, message, model_name=self._loop.name, phase=self._loop.phase,
                       operation_id=intent.operation_id)

    def _engine_refusal(self, finished: AdapterDone) -> Refused | EngineFailed:
        """An engine's 4xx says the request was wrong (a duplicate, a path with no adapter)."""
        loop = self._loop
        message = (f"{finished.action.value} of {finished.name!r} on {loop.name!r}: "
                   f"{finished.error}")
        operation_id = finished.request.intent.operation_id if finished.request else None
        if finished.status is not None and 400 <= finished.status < 500:
            kind = Refusal.CONFLICT if finished.status == 409 else Refusal.INVALID
            return Refused(kind, message, model_name=loop.name, phase=loop.phase,
                           operation_id=operation_id)
        return EngineFailed(loop.name, message, loop.phase, operation_id)

    def sync_after_ready(self) -> None:
        """Load what the record holds and the engine does not serve (after a start or
        adoption)."""
        loop = self._loop
        wanted = list(loop.record.adapters)
        if not wanted:
            return
        gen, engine, s = loop.generation, self._engine, self._settings

        async def run() -> None:
            serving = await engine.loaded_adapters(s.probe_timeout_s) or {}
            loaded, failed = set(serving), []
            for item in wanted:
                if item.name in serving:
                    continue
                try:
                    await engine.load_adapter(item.name, item.path, s.lifecycle_timeout_s)
                    loaded.add(item.name)
                except EngineCallError as exc:
                    failed.append((item.name, str(exc)))
            loop.post(AdaptersSynced(gen, frozenset(loaded), tuple(failed)))

        loop.helper(run())

    def on_synced(self, synced: AdaptersSynced) -> None:
        self._loaded = set(synced.loaded)
        for name, error in synced.failed:
            self._loop.emit("AdapterLoadFailed",
                            f"{name}: {error} (kept; tried again at the next start)")

    @staticmethod
    def _details(name: str, loaded: bool, adapters: list[LoraAdapter]) -> dict[str, object]:
        return {"lora_name": name, "loaded": loaded,
                "adapters": sorted(a.name for a in adapters)}
