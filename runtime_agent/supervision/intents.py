"""How an engine's owner answers what callers ask: sleep, wake, a KV limit.

Functions over ``EngineOwner`` (kept apart so the owner's loop stays readable), called only
from inside the owner's task. A sleep or wake is admitted against GPU and host memory first, then runs in a
helper task whose result comes back as ``OpDone``; a second sleep or wake waits for the first.
A repeated operation id answers ``Done(changed=False)`` with what was recorded, also after an
agent restart, since operation ids are kept in the durable record.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from contract.phases import Phase
from contract.reasons import SLEEP_FAILED, STORAGE_UNAVAILABLE, WAKE_FAILED
from engines.client import EngineCallError
from registry.record import InFlight
from runtime_agent.gpu.admission import Refuse
from runtime_agent.kv.hold import changed_by
from runtime_agent.supervision.messages import (
    Action,
    Intent,
    LoadAdapter,
    OpDone,
    Request,
    Revive,
    SetKvLimit,
    Sleep,
    Stop,
    UnloadAdapter,
)
from runtime_agent.supervision.outcomes import (
    Done,
    EngineFailed,
    Outcome,
    Refusal,
    Refused,
)

if TYPE_CHECKING:
    from runtime_agent.supervision.owner import EngineOwner


def resolve(future: asyncio.Future[Outcome], outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)


def no_room(refused: Refuse, message: str, **extra: Any) -> Refused:
    """A memory refusal as an outcome: what was needed, what is free, who holds it."""
    kind = Refusal.NO_ROOM if refused.reason != "TooLargeForAnyCard" else Refusal.INVALID
    return Refused(kind, message, refused.reason, details={
        "needed_bytes": refused.needed, "free_bytes": refused.free,
        "holders": [{"model_name": k, "bytes": b} for k, b in refused.holders]}, **extra)


def done(owner: EngineOwner, phase: Phase | None, intent: Intent, changed: bool = True,
          details: dict[str, Any] | None = None) -> Done:
    return Done(owner.name, phase, changed, intent.operation_id, details or {})


async def on_request(owner: EngineOwner, request: Request) -> None:
    intent = request.intent
    if isinstance(intent, Stop):
        await owner._stop(request)
        return
    if isinstance(intent, Revive):
        await owner._revive(request)
        return
    if intent.operation_id and intent.operation_id in owner.record.operations:
        recorded = owner.record.operations[intent.operation_id]
        resolve(request.reply, done(owner, owner.view.phase, intent, changed=False,
                                          details=_replayed(recorded)))
        return
    if isinstance(intent, SetKvLimit):
        await set_kv_limit(owner, request, intent)
        return
    if owner._op is not None:
        owner._deferred.append(request)
        return
    if isinstance(intent, LoadAdapter | UnloadAdapter):
        from runtime_agent.supervision import adapters  # it uses this module's helpers

        if isinstance(intent, LoadAdapter):
            await adapters.on_load(owner, request, intent)
        else:
            await adapters.on_unload(owner, request, intent)
        return
    phase = owner.view.phase
    want_sleep = isinstance(intent, Sleep)
    if (want_sleep and phase is Phase.SLEEPING) or (not want_sleep and phase is Phase.ACTIVE):
        resolve(request.reply, done(owner, phase, intent, changed=False))
        return
    if phase not in (Phase.ACTIVE, Phase.SLEEPING):
        resolve(request.reply, Refused(
            Refusal.CONFLICT, f"model {owner.name!r} is {phase.value}; it can "
            f"{intent.action.value} once it is active or sleeping", model_name=owner.name,
            phase=phase, operation_id=intent.operation_id))
        return
    if want_sleep and (why := owner._adapter.sleep_unsupported()) is not None:
        resolve(request.reply, Refused(Refusal.CONFLICT, f"model {owner.name!r} cannot "
                                       f"sleep: {why}", model_name=owner.name, phase=phase,
                                       operation_id=intent.operation_id))
        return
    if (unwritable := owner._deps.storage.refusal(owner.name)) is not None:
        resolve(request.reply, unwritable)
        return
    level = intent.level if isinstance(intent, Sleep) else (owner.record.sleep_level or 1)
    if owner.spec.engine == "sglang":
        level = 1  # SGLang keeps its weights in host memory on every sleep (engines/sglang.py)
    memory = owner._deps.memory
    refused = memory.admit_sleep(owner.name, level) if want_sleep else None
    if not want_sleep:
        claimed = memory.claim_wake(owner.name)
        refused = claimed if isinstance(claimed, Refuse) else None
    if refused is not None:
        resolve(request.reply, no_room(
            refused, f"model {owner.name!r} cannot {intent.action.value} now: "
            f"{refused.message}", model_name=owner.name, phase=phase,
            operation_id=intent.operation_id))
        return
    await start_op(owner, Action.SLEEP if want_sleep else Action.WAKE, level, request)


async def sleep_after_restart(owner: EngineOwner) -> None:
    """A restarted engine that was asleep is put back to sleep once it is ready."""
    level = owner.record.sleep_level or 1
    refused = owner._deps.memory.admit_sleep(owner.name, level)
    if refused is None:
        await start_op(owner, Action.SLEEP, level, None)
    else:
        owner._emit(refused.reason, f"stays awake after its restart: {refused.message}")


async def start_op(owner: EngineOwner, action: Action, level: int,
                   request: Request | None) -> None:
    gen = owner._gen
    started = time.monotonic()
    memory = owner._deps.memory
    # Durable before the engine is called: an agent that dies meanwhile finds it and asks the
    # engine how the call ended, instead of believing its old phase. A record that cannot be
    # written sends nothing: the engine stays as it was, and the caller hears why (503).
    owner.record.operation = InFlight(action="sleep" if action is Action.SLEEP else "wake",
                                      level=level, started_at=owner._deps.clock())
    if not await owner._persist():
        owner.record.operation = None
        if action is Action.SLEEP:
            memory.set_sleeping(owner.name, False)  # gives back the host room it admitted
        else:
            memory.release_claim(owner.name)
        refused = owner._deps.storage.refusal(owner.name) or Refused(
            Refusal.UNAVAILABLE, "its record cannot be written", STORAGE_UNAVAILABLE, owner.name)
        if request is not None:
            resolve(request.reply, replace(refused, phase=owner.view.phase,
                                           operation_id=request.intent.operation_id))
        else:
            owner._emit(STORAGE_UNAVAILABLE, f"not put back to sleep: {refused.message}")
        return
    if action is Action.SLEEP:
        memory.set_sleeping(owner.name, True)  # figures from here on are not its awake size

    async def run() -> None:
        error: str | None = None
        try:
            if action is Action.SLEEP:
                await owner._adapter.sleep(level, owner._settings.lifecycle_timeout_s)
            else:
                # a wake of known size shares its cards' turn; one of unknown size is alone
                async with memory.gate.turn(owner.record.devices, label=owner.name,
                                            shared=memory.wake_is_sized(owner.name)):
                    await owner._adapter.wake(level, owner._settings.lifecycle_timeout_s)
        except EngineCallError as exc:
            error = str(exc)
        sleeping = await owner._adapter.is_sleeping(owner._settings.probe_timeout_s)
        owner._inbox.put_nowait(OpDone(gen, action, level, error, sleeping, request,
                                      time.monotonic() - started))

    task = asyncio.create_task(run(), name=f"{action.value}:{owner.name}")
    owner._op = (task, action.value, request)
    owner._publish()


async def on_op_done(owner: EngineOwner, finished: OpDone) -> None:
    owner._op = None
    owner.record.operation = None
    action, level, error, request = finished.action, finished.level, finished.error, finished.request
    want_sleeping = action is Action.SLEEP
    sleeping = finished.sleeping
    if sleeping is None:  # no confirmation: trust the call's own result
        sleeping = want_sleeping if error is None else not want_sleeping
    ok = error is None and sleeping == want_sleeping
    if not sleeping:
        owner._deps.memory.set_sleeping(owner.name, False)
    if not ok and not want_sleeping:
        owner._deps.memory.release_claim(owner.name)
    if ok:
        owner.record.desired = "asleep" if want_sleeping else "awake"
        owner.record.sleep_level = level if want_sleeping else None
    owner.record.count_operation(action.value, "success" if ok else "failure")
    target = Phase.SLEEPING if sleeping else Phase.ACTIVE
    failed = SLEEP_FAILED if want_sleeping else WAKE_FAILED
    reason = ("Slept" if want_sleeping else "Woken") if ok else failed
    detail = (f"{action.value} took {finished.seconds:.3f} s" if ok
              else (error or f"engine did not {action.value}"))
    if target is not owner.view.phase:
        await owner._transition(target, reason, detail, persist=False,
                               duration_s=finished.seconds)
    else:
        owner._emit(reason, detail, to=target, duration_s=finished.seconds)
    if request is not None:
        intent = request.intent
        if ok and intent.operation_id:
            owner.record.remember_operation(intent.operation_id, {"action": action.value})
        await owner._persist()
        if ok:
            resolve(request.reply, done(owner, target, intent))
        else:
            resolve(request.reply, EngineFailed(
                owner.name, f"{action.value} of {owner.name!r} failed: {detail}", target,
                intent.operation_id))
    else:
        await owner._persist()
    if ok and action is Action.WAKE:
        from runtime_agent.supervision import adapters

        adapters.sync_after_ready(owner)  # an engine woken after a restart gets its adapters
    while owner._deferred and owner._op is None:
        await on_request(owner, owner._deferred.popleft())


async def set_kv_limit(owner: EngineOwner, request: Request, intent: SetKvLimit) -> None:
    phase = owner.view.phase
    if phase in (Phase.FAILED, Phase.STOPPING, Phase.STOPPED):
        resolve(request.reply, Refused(
            Refusal.CONFLICT, f"model {owner.name!r} is {phase.value}; its KV limit cannot "
            "be set", model_name=owner.name, phase=phase, operation_id=intent.operation_id))
        return
    if (unwritable := owner._deps.storage.refusal(owner.name)) is not None:
        resolve(request.reply, unwritable)
        return
    before = owner._kv.state
    detail = await owner._kv.request(intent.limit_bytes)
    changed = changed_by(before, owner._kv.state)  # `applied`: the segment (or the wait) moved
    if intent.operation_id and detail["in_force"]:
        owner.record.remember_operation(intent.operation_id,
                                       {"action": Action.KV_LIMIT.value, **detail})
    await owner._persist()
    owner._publish()
    resolve(request.reply, done(owner, phase, intent, changed=changed, details=detail))


def fail_op(owner: EngineOwner, why: str) -> None:
    """Cancel the operation in flight and answer everyone waiting on one: ``why``."""
    waiting = list(owner._deferred)
    owner._deferred.clear()
    if owner._op is not None:
        task, _, request = owner._op
        task.cancel()
        owner._op = None
        if request is not None:
            waiting.insert(0, request)
    for request in waiting:
        resolve(request.reply, Refused(Refusal.CONFLICT, f"{why}; try again",
                                       model_name=owner.name, phase=owner.view.phase,
                                       operation_id=request.intent.operation_id))


def _replayed(recorded: dict[str, Any]) -> dict[str, Any]:
    """What a replayed operation answers besides its status: the recorded KV figures."""
    return {k: v for k, v in recorded.items()
            if k not in ("status", "model_name", "operation_id", "applied", "phase", "action")}
