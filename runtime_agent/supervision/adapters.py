"""LoRA adapters of one engine: loaded at run time, kept in the record, never lost to a restart.

Functions over ``EngineOwner``, called only from inside the owner's task. An adapter is desired
state: it is written to the durable record first, then loaded into the engine by a helper task
(the owner keeps answering meanwhile; a sleep or wake waits for it, as they wait for each other).
An engine that is not awake gets its adapters when it is. After every start the owner loads the
record's adapters again, and after a re-adoption it asks the engine which ones it serves and
loads the missing ones, so an agent or engine restart loses none.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from contract.engines import adapter_name_problem, lora_enabled
from contract.phases import Phase
from engines.client import EngineCallError
from registry.record import LoraAdapter
from runtime_agent.supervision.intents import done, resolve
from runtime_agent.supervision.messages import (
    Action,
    AdapterDone,
    AdaptersSynced,
    LoadAdapter,
    Request,
    UnloadAdapter,
)
from runtime_agent.supervision.outcomes import EngineFailed, Refusal, Refused

if TYPE_CHECKING:
    from runtime_agent.supervision.owner import EngineOwner


def _refuse(owner: EngineOwner, request: Request, kind: Refusal, message: str) -> None:
    resolve(request.reply, Refused(kind, message, model_name=owner.name, phase=owner.view.phase,
                                   operation_id=request.intent.operation_id))


async def on_load(owner: EngineOwner, request: Request, intent: LoadAdapter) -> None:
    spec = owner.spec
    if (problem := adapter_name_problem(intent.name)) is not None:
        _refuse(owner, request, Refusal.INVALID, problem)
        return
    if not lora_enabled(spec.engine, spec.args):
        _refuse(owner, request, Refusal.INVALID, f"model {owner.name!r} was not started for "
                "LoRA adapters; activate it with engine_config.args {\"--enable-lora\": \"\"}")
        return
    if (unwritable := owner._deps.storage.refusal(owner.name)) is not None:
        resolve(request.reply, unwritable)
        return
    known = next((a for a in owner.record.adapters if a.name == intent.name), None)
    if known is not None and known.path != intent.path:
        _refuse(owner, request, Refusal.CONFLICT, f"adapter {intent.name!r} is already loaded "
                f"from {known.path!r}; unload it first to load it from elsewhere")
        return
    if known is not None and intent.name in owner._adapters_loaded:
        resolve(request.reply, done(owner, owner.view.phase, intent, changed=False,
                                    details=_details(owner, intent.name, loaded=True)))
        return
    if known is None:
        owner.record.adapters.append(LoraAdapter(name=intent.name, path=intent.path,
                                                 artifact_url=intent.artifact_url))
        await owner._persist()  # durable first: a restart loads it even if this call fails
    if owner.view.phase is not Phase.ACTIVE:
        resolve(request.reply, done(owner, owner.view.phase, intent, details={
            **_details(owner, intent.name, loaded=False), "in_force": False,
            "message": f"loaded when {owner.name!r} is awake and ready"}))
        return
    _start(owner, Action.LOAD_ADAPTER, intent.name, intent.path, request)


async def on_unload(owner: EngineOwner, request: Request, intent: UnloadAdapter) -> None:
    known = next((a for a in owner.record.adapters if a.name == intent.name), None)
    if known is None:
        resolve(request.reply, done(owner, owner.view.phase, intent, changed=False, details={
            "lora_name": intent.name, "message": "no such adapter; nothing to do"}))
        return
    owner.record.adapters.remove(known)
    await owner._persist()
    if intent.name not in owner._adapters_loaded or owner._proc is None:
        owner._adapters_loaded.discard(intent.name)
        resolve(request.reply, done(owner, owner.view.phase, intent,
                                    details=_details(owner, intent.name, loaded=False)))
        return
    _start(owner, Action.UNLOAD_ADAPTER, intent.name, "", request)


def _start(owner: EngineOwner, action: Action, name: str, path: str,
           request: Request | None) -> None:
    gen, timeout = owner._gen, owner._settings.lifecycle_timeout_s

    async def run() -> None:
        error, status = None, None
        try:
            if action is Action.LOAD_ADAPTER:
                await owner._adapter.load_adapter(name, path, timeout)
            else:
                await owner._adapter.unload_adapter(name, timeout)
        except EngineCallError as exc:
            error, status = str(exc), exc.status
        owner._inbox.put_nowait(AdapterDone(gen, action, name, error, status, request))

    owner._op = (asyncio.create_task(run(), name=f"{action.value}:{owner.name}"), action.value,
                 request)
    owner._publish()


async def on_adapter_done(owner: EngineOwner, finished: AdapterDone) -> None:
    from runtime_agent.supervision import intents

    owner._op = None
    loading = finished.action is Action.LOAD_ADAPTER
    gone = finished.error is not None and finished.status == 404 and not loading
    if finished.error is None or gone:
        if loading:
            owner._adapters_loaded.add(finished.name)
        else:
            owner._adapters_loaded.discard(finished.name)
        owner._emit("AdapterLoaded" if loading else "AdapterUnloaded", finished.name)
        if finished.request is not None:
            resolve(finished.request.reply, done(owner, owner.view.phase,
                                                 finished.request.intent,
                                                 details=_details(owner, finished.name, loading)))
    else:
        if loading:  # the engine refused it: it is not desired any more
            owner.record.adapters = [a for a in owner.record.adapters if a.name != finished.name]
            await owner._persist()
        owner._emit("AdapterLoadFailed" if loading else "AdapterUnloadFailed",
                    f"{finished.name}: {finished.error}")
        if finished.request is not None:
            resolve(finished.request.reply, _engine_refusal(owner, finished))
    while owner._deferred and owner._op is None:
        await intents.on_request(owner, owner._deferred.popleft())


def _engine_refusal(owner: EngineOwner, finished: AdapterDone) -> Refused | EngineFailed:
    """An engine's 4xx says the request was wrong (a duplicate, a path with no adapter)."""
    message = f"{finished.action.value} of {finished.name!r} on {owner.name!r}: {finished.error}"
    operation_id = finished.request.intent.operation_id if finished.request else None
    if finished.status is not None and 400 <= finished.status < 500:
        kind = Refusal.CONFLICT if finished.status == 409 else Refusal.INVALID
        return Refused(kind, message, model_name=owner.name, phase=owner.view.phase,
                       operation_id=operation_id)
    return EngineFailed(owner.name, message, owner.view.phase, operation_id)


def sync_after_ready(owner: EngineOwner) -> None:
    """Load what the record holds and the engine does not serve (after a start or adoption)."""
    wanted = list(owner.record.adapters)
    if not wanted:
        return
    gen, adapter, timeout = owner._gen, owner._adapter, owner._settings.lifecycle_timeout_s

    async def run() -> None:
        serving = await adapter.loaded_adapters(owner._settings.probe_timeout_s) or {}
        loaded, failed = set(serving), []
        for item in wanted:
            if item.name in serving:
                continue
            try:
                await adapter.load_adapter(item.name, item.path, timeout)
                loaded.add(item.name)
            except EngineCallError as exc:
                failed.append((item.name, str(exc)))
        owner._inbox.put_nowait(AdaptersSynced(gen, frozenset(loaded), tuple(failed)))

    owner._helper(run())


def on_synced(owner: EngineOwner, synced: AdaptersSynced) -> None:
    owner._adapters_loaded = set(synced.loaded)
    for name, error in synced.failed:
        owner._emit("AdapterLoadFailed", f"{name}: {error} (kept; tried again at the next start)")


def _details(owner: EngineOwner, name: str, loaded: bool) -> dict[str, object]:
    return {"lora_name": name, "loaded": loaded,
            "adapters": sorted(a.name for a in owner.record.adapters)}
