"""LoRA adapters of one engine: loaded at run time, kept in the record, never lost to a restart.

Called only from inside the owner's task. An adapter is desired state: it is written to the
durable record first, then loaded into the engine by a helper task (the owner keeps answering
meanwhile; a sleep or wake waits for it, as they wait for each other: the ``OperationSlot``).
An engine that is not awake gets its adapters when it is. After every start the owner loads the
record's adapters again, and after a re-adoption it asks the engine which ones it serves and
loads the missing ones, so an agent or engine restart loses none. ``Lora`` keeps the set of
adapters the current process serves; the loop clears it when the process changes.
"""

from __future__ import annotations

import asyncio

from contract.engines import adapter_name_problem, lora_enabled
from contract.phases import Phase
from engines.adapter import EngineAdapter
from engines.client import EngineCallError
from registry.record import LoraAdapter
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
from runtime_agent.supervision.outcomes import EngineFailed, Refusal, Refused
from runtime_agent.supervision.owner.answers import done, refuse, resolve
from runtime_agent.supervision.owner.port import OwnerLoop
from runtime_agent.supervision.owner.slots import OperationSlot, ProcessSlot


class Lora:
    def __init__(self, loop: OwnerLoop, ops: OperationSlot, procs: ProcessSlot,
                 engine: EngineAdapter, storage: StorageHealth, settings: Settings) -> None:
        self._loop, self._ops, self._procs = loop, ops, procs
        self._engine, self._storage, self._settings = engine, storage, settings
        self._loaded: set[str] = set()  # the adapters the current process serves

    def serves(self, name: str) -> bool:
        return name in self._loaded

    def new_process(self) -> None:
        """A new process, or none: it serves no adapter yet."""
        self._loaded = set()

    async def on_load(self, request: Request, intent: LoadAdapter) -> None:
        loop = self._loop
        spec, name, phase = loop.record.spec, loop.name, loop.phase
        if (problem := adapter_name_problem(intent.name)) is not None:
            refuse(request, Refusal.INVALID, problem, name, phase)
            return
        if not lora_enabled(spec.engine, spec.args):
            refuse(request, Refusal.INVALID, f"model {name!r} was not started for LoRA "
                   "adapters; activate it with engine_config.args {\"--enable-lora\": \"\"}",
                   name, phase)
            return
        if (unwritable := self._storage.refusal(name)) is not None:
            resolve(request.reply, unwritable)
            return
        known = next((a for a in loop.record.adapters if a.name == intent.name), None)
        if known is not None and known.path != intent.path:
            refuse(request, Refusal.CONFLICT, f"adapter {intent.name!r} is already loaded "
                   f"from {known.path!r}; unload it first to load it from elsewhere", name, phase)
            return
        if known is not None and intent.name in self._loaded:
            resolve(request.reply, done(name, phase, intent, changed=False,
                                        details=self._details(intent.name, loaded=True)))
            return
        if known is None:
            loop.record.adapters.append(LoraAdapter(name=intent.name, path=intent.path,
                                                    artifact_url=intent.artifact_url))
            await loop.persist()  # durable first: a restart loads it even if this call fails
        if loop.phase is not Phase.ACTIVE:
            resolve(request.reply, done(name, loop.phase, intent, details={
                **self._details(intent.name, loaded=False), "in_force": False,
                "message": f"loaded when {name!r} is awake and ready"}))
            return
        self._start(Action.LOAD_ADAPTER, intent.name, intent.path, request)

    async def on_unload(self, request: Request, intent: UnloadAdapter) -> None:
        loop = self._loop
        known = next((a for a in loop.record.adapters if a.name == intent.name), None)
        if known is None:
            resolve(request.reply, done(loop.name, loop.phase, intent, changed=False, details={
                "lora_name": intent.name, "message": "no such adapter; nothing to do"}))
            return
        loop.record.adapters.remove(known)
        await loop.persist()
        if intent.name not in self._loaded or self._procs.proc is None:
            self._loaded.discard(intent.name)
            resolve(request.reply, done(loop.name, loop.phase, intent,
                                        details=self._details(intent.name, loaded=False)))
            return
        self._start(Action.UNLOAD_ADAPTER, intent.name, "", request)

    def _start(self, action: Action, name: str, path: str, request: Request | None) -> None:
        loop, engine = self._loop, self._engine
        gen, timeout = loop.generation, self._settings.lifecycle_timeout_s

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

    async def on_done(self, finished: AdapterDone) -> None:
        loop = self._loop
        self._ops.finish()
        loading = finished.action is Action.LOAD_ADAPTER
        gone = finished.error is not None and finished.status == 404 and not loading
        if finished.error is None or gone:
            if loading:
                self._loaded.add(finished.name)
            else:
                self._loaded.discard(finished.name)
            loop.emit("AdapterLoaded" if loading else "AdapterUnloaded", finished.name)
            if finished.request is not None:
                resolve(finished.request.reply, done(
                    loop.name, loop.phase, finished.request.intent,
                    details=self._details(finished.name, loading)))
        else:
            if loading:  # the engine refused it: it is not desired any more
                loop.record.adapters = [a for a in loop.record.adapters
                                        if a.name != finished.name]
                await loop.persist()
            loop.emit("AdapterLoadFailed" if loading else "AdapterUnloadFailed",
                      f"{finished.name}: {finished.error}")
            if finished.request is not None:
                resolve(finished.request.reply, self._engine_refusal(finished))

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

    def _details(self, name: str, loaded: bool) -> dict[str, object]:
        return {"lora_name": name, "loaded": loaded,
                "adapters": sorted(a.name for a in self._loop.record.adapters)}
