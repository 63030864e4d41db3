"""How an engine's owner answers what callers ask: sleep, wake, a KV limit, a LoRA adapter.

Called only from inside the owner's task, through ``OwnerLoop`` (``port``) and the parts it is
given. A sleep or wake is admitted against GPU and host memory first, then runs in a helper task
whose result comes back as ``OpDone``; a second sleep or wake waits for the first (the
``OperationSlot``'s deferred requests, drained by the loop). A repeated operation id answers
``Done(changed=False)`` with what was recorded, also after an agent restart, since operation ids
are kept in the durable record. A stop and a revive are the loop's own (they end or restart
the process) and never reach here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from msgspec.structs import replace

from contract.phases import Phase
from contract.reasons import SLEEP_FAILED, STORAGE_UNAVAILABLE, WAKE_FAILED
from engines.driver import EngineDriver
from engines.client import EngineCallError
from runtime_agent.gpu.admission import Refuse
from runtime_agent.gpu.broker import MemoryBroker
from runtime_agent.kv.hold import changed_by
from runtime_agent.kv.keeper import KvKeeper
from runtime_agent.settings import Settings
from runtime_agent.supervision.durability import StorageHealth
from runtime_agent.supervision.messages import (
    Action,
    LoadAdapter,
    OpDone,
    Request,
    SetKvLimit,
    Sleep,
    UnloadAdapter,
)
from runtime_agent.supervision.outcomes import EngineFailed, Refusal, Refused
from runtime_agent.supervision.owner.answers import done, no_room, refuse, resolve
from runtime_agent.supervision.owner.lora import Lora
from runtime_agent.supervision.owner.port import OwnerLoop
from runtime_agent.supervision.owner.slots import OperationSlot


class Intents:
    def __init__(self, loop: OwnerLoop, ops: OperationSlot, lora: Lora, kv: KvKeeper,
                 engine: EngineDriver, memory: MemoryBroker, storage: StorageHealth,
                 settings: Settings) -> None:
        self._loop, self._ops, self._lora, self._kv = loop, ops, lora, kv
        self._engine, self._memory, self._storage, self._settings = (engine, memory, storage,
                                                                     settings)

    @property
    def busy(self) -> bool:
        """A sleep, wake or LoRA call is in flight."""
        return self._ops.busy

    async def on_request(self, request: Request) -> None:
        loop, intent = self._loop, request.intent
        if intent.operation_id and intent.operation_id in loop.record.operations:
            recorded = loop.record.operations[intent.operation_id]
            resolve(request.reply, done(loop.name, loop.phase, intent, changed=False,
                                        details=_replayed(recorded)))
            return
        if isinstance(intent, SetKvLimit):
            await self.set_kv_limit(request, intent)
            return
        if self._ops.busy:
            self._ops.defer(request)
            return
        if isinstance(intent, LoadAdapter):
            await self._lora.on_load(request, intent)
            return
        if isinstance(intent, UnloadAdapter):
            await self._lora.on_unload(request, intent)
            return
        await self._sleep_or_wake(request)

    async def _sleep_or_wake(self, request: Request) -> None:
        loop, intent, name = self._loop, request.intent, self._loop.name
        phase = loop.phase
        want_sleep = isinstance(intent, Sleep)
        if (want_sleep and phase is Phase.SLEEPING) or (not want_sleep and phase is Phase.ACTIVE):
            resolve(request.reply, done(name, phase, intent, changed=False))
            return
        if phase not in (Phase.ACTIVE, Phase.SLEEPING):
            refuse(request, Refusal.CONFLICT, f"model {name!r} is {phase.value}; it can "
                   f"{intent.action.value} once it is active or sleeping", name, phase)
            return
        if want_sleep and (why := self._engine.sleep_unsupported()) is not None:
            refuse(request, Refusal.CONFLICT, f"model {name!r} cannot sleep: {why}", name, phase)
            return
        if (unwritable := self._storage.refusal(name)) is not None:
            resolve(request.reply, unwritable)
            return
        level = intent.level if isinstance(intent, Sleep) else (loop.record.sleep_level or 1)
        if loop.record.spec.engine == "sglang":
            level = 1  # SGLang keeps its weights in host memory on every sleep (engines/sglang.py)
        memory = self._memory
        refused = memory.admit_sleep(name, level) if want_sleep else None
        if not want_sleep:
            claimed = memory.claim_wake(name)
            refused = claimed if isinstance(claimed, Refuse) else None
        if refused is not None:
            resolve(request.reply, no_room(
                refused, f"model {name!r} cannot {intent.action.value} now: "
                f"{refused.message}", model_name=name, phase=phase,
                operation_id=intent.operation_id))
            return
        await self.start_op(Action.SLEEP if want_sleep else Action.WAKE, level, request)

    async def sleep_after_restart(self) -> None:
        """A restarted engine that was asleep is put back to sleep once it is ready."""
        level = self._loop.record.sleep_level or 1
        refused = self._memory.admit_sleep(self._loop.name, level)
        if refused is None:
            await self.start_op(Action.SLEEP, level, None)
        else:
            self._loop.emit(refused.reason, f"stays awake after its restart: {refused.message}")

    async def start_op(self, action: Action, level: int, request: Request | None) -> None:
        loop, memory, engine, s = self._loop, self._memory, self._engine, self._settings
        name, record, clock = loop.name, loop.record, loop.clock
        gen = loop.generation
        started = clock.now()
        from registry.record import InFlight  # loaded with the first engine, not at start

        # Durable before the engine is called: an agent that dies meanwhile finds it and asks
        # the engine how the call ended, instead of believing its old phase. A record that
        # cannot be written sends nothing: the engine stays as it was, and the caller hears
        # why (503).
        record.operation = InFlight(action="sleep" if action is Action.SLEEP else "wake",
                                    level=level, started_at=clock.wall())
        if not await loop.persist():
            record.operation = None
            if action is Action.SLEEP:
                memory.set_sleeping(name, False)  # gives back the host room it admitted
            else:
                memory.release_claim(name)
            refused = self._storage.refusal(name) or Refused(
                Refusal.UNAVAILABLE, "its record cannot be written", STORAGE_UNAVAILABLE, name)
            if request is not None:
                resolve(request.reply, replace(refused, phase=loop.phase,
                                               operation_id=request.intent.operation_id))
            else:
                loop.emit(STORAGE_UNAVAILABLE, f"not put back to sleep: {refused.message}")
            return
        if action is Action.SLEEP:
            memory.set_sleeping(name, True)  # figures from here on are not its awake size

        async def run() -> None:
            error: str | None = None
            try:
                if action is Action.SLEEP:
                    await engine.sleep(level, s.lifecycle_timeout_s)
                else:
                    # a wake of known size shares its cards' turn; one of unknown size is alone
                    async with memory.gate.turn(record.devices, label=name,
                                                shared=memory.wake_is_sized(name)):
                        await engine.wake(level, s.lifecycle_timeout_s)
            except EngineCallError as exc:
                error = str(exc)
            sleeping = await engine.is_sleeping(s.probe_timeout_s)
            loop.post(OpDone(gen, action, level, error, sleeping, request,
                             clock.now() - started))

        self._ops.start(asyncio.create_task(run(), name=f"{action.value}:{name}"),
                        action.value, request)
        loop.publish()

    async def on_op_done(self, finished: OpDone) -> None:
        loop, record, name = self._loop, self._loop.record, self._loop.name
        self._ops.finish()
        record.operation = None
        action, level, error, request = (finished.action, finished.level, finished.error,
                                         finished.request)
        want_sleeping = action is Action.SLEEP
        sleeping = finished.sleeping
        if sleeping is None:  # no confirmation: trust the call's own result
            sleeping = want_sleeping if error is None else not want_sleeping
        ok = error is None and sleeping == want_sleeping
        if not sleeping:
            self._memory.set_sleeping(name, False)
        if not ok and not want_sleeping:
            self._memory.release_claim(name)
        if ok:
            record.desired = "asleep" if want_sleeping else "awake"
            record.sleep_level = level if want_sleeping else None
        record.count_operation(action.value, "success" if ok else "failure")
        target = Phase.SLEEPING if sleeping else Phase.ACTIVE
        failed = SLEEP_FAILED if want_sleeping else WAKE_FAILED
        reason = ("Slept" if want_sleeping else "Woken") if ok else failed
        detail = (f"{action.value} took {finished.seconds:.3f} s" if ok
                  else (error or f"engine did not {action.value}"))
        if target is not loop.phase:
            await loop.transition(target, reason, detail, persist=False,
                                  duration_s=finished.seconds)
        else:
            loop.emit(reason, detail, to=target, duration_s=finished.seconds)
        if request is not None:
            intent = request.intent
            if ok and intent.operation_id:
                record.remember_operation(intent.operation_id, {"action": action.value})
            await loop.persist()
            if ok:
                resolve(request.reply, done(name, target, intent))
            else:
                resolve(request.reply, EngineFailed(
                    name, f"{action.value} of {name!r} failed: {detail}", target,
                    intent.operation_id))
        else:
            await loop.persist()
        if ok and action is Action.WAKE:
            self._lora.sync_after_ready()  # an engine woken after a restart gets its adapters

    async def set_kv_limit(self, request: Request, intent: SetKvLimit) -> None:
        loop, name = self._loop, self._loop.name
        phase = loop.phase
        if phase in (Phase.FAILED, Phase.STOPPING, Phase.STOPPED):
            refuse(request, Refusal.CONFLICT, f"model {name!r} is {phase.value}; its KV limit "
                   "cannot be set", name, phase)
            return
        if (unwritable := self._storage.refusal(name)) is not None:
            resolve(request.reply, unwritable)
            return
        before = self._kv.state
        detail = await self._kv.request(intent.limit_bytes)
        changed = changed_by(before, self._kv.state)  # `applied`: the segment (or wait) moved
        if intent.operation_id and detail["in_force"]:
            loop.record.remember_operation(intent.operation_id,
                                           {"action": Action.KV_LIMIT.value, **detail})
        await loop.persist()
        loop.publish()
        resolve(request.reply, done(name, phase, intent, changed=changed, details=detail))

    def fail_all(self, why: str) -> None:
        """Cancel the operation in flight and answer everyone waiting on one: ``why``."""
        for request in self._ops.fail_all():
            refuse(request, Refusal.CONFLICT, f"{why}; try again", self._loop.name,
                   self._loop.phase)


def _replayed(recorded: dict[str, Any]) -> dict[str, Any]:
    """What a replayed operation answers besides its status: the recorded KV figures."""
    return {k: v for k, v in recorded.items()
            if k not in ("status", "model_name", "operation_id", "applied", "phase", "action")}
