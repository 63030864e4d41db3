"""The engine owner: one asyncio task per engine that alone changes that engine's state.

API handlers send the owner an intent (sleep, wake, stop) and await its outcome; everything the
engine does on its own (exits, becomes ready, reports request figures) reaches the owner as an
event in the same inbox. The owner handles one message at a time, so every decision that leads
to a start, stop, sleep or wake is made with the owner's own, current state. Long work (a 10 s
sleep call, readiness probing, scraping: ``runtime_agent.supervision.watchers``) runs in helper tasks that
post their results back, so the owner keeps answering (a stop, an exit) while an engine call is
in flight. No lock exists.

Readers (the snapshot, the metrics) read ``owner.view``: an immutable value replaced on every
change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from contract.phases import Phase, check_transition
from engines.adapter import Observation
from engines.client import EngineCallError
from engines.process import (
    EngineProcess,
    ExitInfo,
    ProcessLauncher,
    SpawnError,
    tail_lines,
)
from registry.record import EngineRecord, EngineSpec
from registry.store import RegistryStore
from runtime_agent.artifacts.staging import EngineStager, StagingFailed, StagingView
from runtime_agent.gpu.admission import Refuse
from runtime_agent.gpu.broker import MemoryBroker
from runtime_agent.kv.keeper import KvKeeper
from runtime_agent.settings import Settings
from runtime_agent.supervision import watchers
from runtime_agent.supervision.backoff import restart_delay
from runtime_agent.supervision.engine_kinds import engine_command, make_adapter
from runtime_agent.supervision.ports import port_is_free
from runtime_agent.supervision.views import EngineEvent, EngineView, OpResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OwnerDeps:
    settings: Settings
    store: RegistryStore
    launcher: ProcessLauncher
    session: aiohttp.ClientSession
    on_event: Callable[[EngineEvent], None]
    on_view: Callable[[EngineView], None]
    memory: MemoryBroker
    clock: Callable[[], float] = time.time
    # Issue 14 hook: the weight cache (None: off). See _stage_first.
    stager: EngineStager | None = None


@dataclass(frozen=True)
class Intent:
    action: str  # "sleep" | "wake" | "stop" | "kv_limit"
    operation_id: str | None = None
    level: int = 1
    limit_bytes: int = 0


class EngineOwner:
    def __init__(self, record: EngineRecord, deps: OwnerDeps) -> None:
        self.record = record
        self._deps = deps
        self._settings = deps.settings
        self._inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._adapter = make_adapter(self._settings, deps.session, record)
        self._exit_cause: str | None = None  # why the agent itself killed the process
        self._proc: EngineProcess | None = None
        self._gen = 0  # bumps with every process; events from older processes are dropped
        self._helpers: set[asyncio.Task[None]] = set()
        # The sleep or wake in flight: its task, action and the caller waiting for it (if any).
        self._op: tuple[asyncio.Task[None], str, asyncio.Future[OpResult] | None] | None = None
        self._deferred: deque[tuple[Intent, asyncio.Future[OpResult]]] = deque()
        self._restart_timer: asyncio.TimerHandle | None = None
        self._turn_task: asyncio.Task[None] | None = None
        self._turn_token = 0
        self._ready = False
        self._adopted = False
        self._converge = True  # after a spawn, steer the engine to the desired sleep state
        self._figures: Observation | None = None
        self._figures_at: float | None = None
        # Issue 14 hook: the cached copy the engine starts on, and the staging it waits for.
        self._model_path: str | None = None
        self._staging: StagingView | None = None
        self._stage_token = 0
        self.spawned: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.log_path = self._settings.logs_dir / f"{record.engine_id}.log"
        self._kv = KvKeeper(record, self._settings.kv_shm_dir, lambda reason, message:
                            self._emit(reason, message))
        self.view = self._make_view()
        self._task: asyncio.Task[None] | None = None

    # ---- public surface -------------------------------------------------------------------

    def start(self, mode: str, pid: int | None = None) -> None:
        """Run the owner. mode: "spawn" (new engine), "adopt" (pid verified by the caller),
        "restart" (its process is gone: restart now, counted), or "idle" (failed: keep it)."""
        if mode == "adopt":  # the recovery verified the process: readers know it at once
            self._adopted = True
            self.view = self._make_view()
        self._task = asyncio.create_task(self._run(mode, pid), name=f"owner:{self.name}")

    @property
    def name(self) -> str:
        return self.record.spec.model_name

    @property
    def spec(self) -> EngineSpec:
        return self.record.spec

    async def request(self, intent: Intent) -> OpResult:
        if self._task is None or self._task.done():
            return OpResult.error(404, f"model {self.name!r} is not running on this agent")
        future: asyncio.Future[OpResult] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(("intent", intent, future))
        return await future

    async def detach(self) -> None:
        """Stop supervising without touching the engine: the agent is shutting down."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._cancel_helpers()
        self._end_turn()
        if self._proc is not None:
            self._proc.close()
        await self._adapter.close()

    # ---- the loop -------------------------------------------------------------------------

    async def _run(self, mode: str, pid: int | None) -> None:
        try:
            if mode == "adopt" and pid is not None:
                await self._adopt(pid)
            elif mode == "restart":
                await self._after_exit(None, "its process was gone when the agent started",
                                       restart_now=True)
            elif mode == "stop":  # the previous agent died while stopping this engine
                if pid is not None and (proc := self._deps.launcher.attach(pid)) is not None:
                    self._proc = proc
                self._inbox.put_nowait(("intent", Intent("stop"),
                                        asyncio.get_running_loop().create_future()))
            elif mode == "spawn":
                await self._persist()  # the record is durable before any process starts
                await self._spawn("activated")
            if mode != "spawn" and not self.spawned.done():
                self.spawned.set_result(None)
            self._publish()  # readers see the start-up's outcome (adopted, say) at once
            while self.view.phase is not Phase.STOPPED:
                message = await self._inbox.get()
                await self._handle(message)
                self._publish()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: record it where an operator looks, keep the agent alive
            log.exception("owner of %s crashed", self.name)
            self.record.last_error = "agent error while supervising this engine (see agent log)"
            self._publish()
            raise

    async def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "intent":
            await self._on_intent(message[1], message[2])
            return
        if kind in ("staging", "staged"):  # issue 14 hook: from the staging helper
            await self._on_staging(*message)
            return
        if kind == "turn":
            phase = self.view.phase
            if (message[1] == self._turn_token and self._proc is None
                    and phase in (Phase.ACTIVATING, Phase.RESTARTING)):
                await self._spawn_now(message[2])
            else:
                self._end_turn()
            return
        if message[1] != self._gen:
            return  # from a process that is gone
        if kind == "exit":
            await self._after_exit(message[2], None)
        elif kind == "unusable":  # stuck or unloadable: end this process; the exit decides
            self._exit_cause = message[2]
            if self._proc is not None:
                self._proc.signal_group(signal.SIGKILL)
        elif kind == "ready":
            await self._on_ready(message[2])
        elif kind == "kv":
            if await self._kv.reading(message[2]):
                await self._persist()
        elif kind == "figures":
            self._figures, self._figures_at = message[2], self._deps.clock()
        elif kind == "op_done":
            await self._on_op_done(*message[2:])
        elif kind == "restart_due":
            self._restart_timer = None
            if self.view.phase is Phase.RESTARTING:
                self.record.restart_count += 1
                await self._spawn(f"restart {self.record.restart_count}")

    # ---- process lifecycle ----------------------------------------------------------------

    async def _spawn(self, reason: str) -> None:
        """Start the engine once it has its turn on its cards (one start or wake at a time)."""
        if self._stage_first(reason):  # issue 14 hook: weights first, then the turn
            return
        devices = tuple(self.record.devices)
        if not devices:
            await self._spawn_now(reason)
            return
        self._end_turn()
        self._turn_token += 1
        token = self._turn_token

        async def hold() -> None:
            async with self._deps.memory.gate.turn(devices):
                self._inbox.put_nowait(("turn", token, reason))
                await asyncio.Event().wait()  # held until the start is over (cancelled)

        self._turn_task = asyncio.create_task(hold(), name=f"turn:{self.name}")

    def _end_turn(self) -> None:
        if self._turn_task is not None:
            self._turn_task.cancel()
            self._turn_task = None

    async def _spawn_now(self, reason: str) -> None:
        spec = self.record.spec
        if not port_is_free(self.record.port, self._settings.engine_bind_host):
            # The engine keeps its port for life; something else listens on it or holds it.
            self._end_turn()
            await self._after_exit(None, f"port {self.record.port} is held by another process, "
                                   "so the engine could not listen on it")
            return
        try:
            argv, env = engine_command(self._settings, self.record, self._adapter,
                                       model_path=self._model_path)  # issue 14 hook
            proc = await self._deps.launcher.spawn(argv, env, self.log_path)
        except (SpawnError, ValueError, OSError) as exc:
            self.record.last_error = f"cannot start engine: {exc}"
            self._end_turn()
            self._deps.memory.stopped(self.name)
            await self._transition(Phase.FAILED, "StartFailed", self.record.last_error)
            if not self.spawned.done():
                self.spawned.set_result(self.record.last_error)
            return
        self._kv.new_process()
        # Ollama loads its model after the server starts; not when it is meant to sleep.
        self._attach(proc, prepare=self.record.desired == "awake" or self.spec.engine != "ollama")
        self.record.pid, self.record.pid_start_time = proc.pid, proc.start_time
        self._converge = True
        await self._transition(Phase.BOOTING, reason, f"pid {proc.pid} on port {self.record.port}")
        if not self.spawned.done():
            self.spawned.set_result(None)
        log.info("engine %s started: pid %d port %d (%s)", spec.model_name, proc.pid,
                 self.record.port, reason)

    async def _adopt(self, pid: int) -> None:
        proc = self._deps.launcher.attach(pid)
        if proc is None:
            self._adopted = False
            await self._after_exit(None, "its process ended while the agent re-adopted it",
                                   restart_now=True)
            return
        self._attach(proc)
        self._adopted = True
        self._converge = False  # the engine's own word on sleep is the truth after adoption
        self._emit("readopted", f"pid {pid} on port {self.record.port}", to=self.view.phase)
        if self.view.phase is Phase.ACTIVATING:
            await self._transition(Phase.BOOTING, "readopted", f"pid {pid}")

    def _attach(self, proc: EngineProcess, prepare: bool = False) -> None:
        self._gen += 1
        gen = self._gen
        self._proc = proc
        self._ready = False
        self._figures = None

        def exited(fut: asyncio.Future[ExitInfo]) -> None:
            if not fut.cancelled():
                self._inbox.put_nowait(("exit", gen, fut.result()))

        proc.exited.add_done_callback(exited)
        post = self._inbox.put_nowait
        self._helper(watchers.probe_ready(self._adapter, self._settings, post, gen, prepare))
        self._helper(watchers.watch_progress(self.log_path, self._settings, post, gen,
                                             lambda: self._ready))
        self._helper(self._kv.watch(lambda info: self._inbox.put_nowait(("kv", gen, info)),
                                    self._settings.kv_watch_s, self._settings.kv_hold_s))

    async def _after_exit(self, info: ExitInfo | None, why: str | None,
                          restart_now: bool = False) -> None:
        """The engine's process is gone without being asked to stop: restart it or fail it.

        The decision and its transition come first (they need no I/O); the leftover segment,
        the log tail and the durable record follow. A restart that falls due meanwhile waits
        in the inbox until this returns."""
        self._cancel_helpers()
        self._end_turn()
        self._gen += 1  # results already queued by the dead process's helpers are void
        self._fail_op("the engine exited during the operation")
        self._proc, self._ready, self._figures = None, False, None
        cause = why or (info.describe() if info else "exited")
        if self._exit_cause is not None:
            cause, self._exit_cause = f"{self._exit_cause} (then {cause})", None
        self.record.last_error = cause
        self.record.pid = self.record.pid_start_time = None
        delay = restart_delay(self.record.restart_count, self._settings.restart_delays)
        if delay is None:  # terminal: no hurry, and the log tail belongs in last_error at once
            await self._add_log_tail(cause)
            self.record.budget_exhausted += 1
            self._deps.memory.stopped(self.name)
            msg = f"{cause}; restart budget of {len(self._settings.restart_delays)} spent"
            await self._transition(Phase.FAILED, "RestartBudgetExhausted", msg, persist=False)
        else:
            self._deps.memory.exited(self.name)
            if restart_now:
                delay = 0.0  # the agent was down for longer than any backoff already
            await self._transition(Phase.RESTARTING, "Exited", f"{cause}; restart in {delay:g} s",
                                   persist=False)
            gen = self._gen
            self._restart_timer = asyncio.get_running_loop().call_later(
                delay, self._inbox.put_nowait, ("restart_due", gen))
            await self._add_log_tail(cause)
        await self._kv.remove_leftover()
        await self._persist()

    async def _add_log_tail(self, cause: str) -> None:
        tail = await asyncio.to_thread(tail_lines, self.log_path, 20)  # blocking file read
        if tail:
            self.record.last_error = cause + "\n" + "\n".join(tail)
            self._publish()

    async def _on_ready(self, sleeping: bool | None) -> None:
        self._ready = True
        self._end_turn()
        target = Phase.SLEEPING if sleeping else Phase.ACTIVE
        # The engine's own word: a re-adopted engine may have finished a sleep its record
        # never saw (the agent died during the call), and the ledger must charge it so.
        self._deps.memory.set_sleeping(self.name, target is Phase.SLEEPING)
        if self._adopted and not self._converge:
            self.record.desired = "asleep" if sleeping else "awake"
        if target is self.view.phase:  # a re-adopted engine: no move, but followers learn it
            self._emit("Ready", "re-adopted engine answers /health", to=target)
        await self._transition(target, "Ready", "answers /health")
        self._helper(watchers.scrape(self._adapter, self._settings, self._inbox.put_nowait,
                                     self._gen))
        if self._converge and self.record.desired == "asleep" and target is Phase.ACTIVE:
            level = self.record.sleep_level or 1
            refused = self._deps.memory.admit_sleep(self.name, level)
            if refused is None:
                self._start_op("sleep", level, None, None)
            else:
                self._emit(refused.reason, f"stays awake after its restart: {refused.message}")

    # ---- weights (issue 14 hook: the whole section) ---------------------------------------

    def _stage_first(self, reason: str) -> bool:
        """Whether the start waits for the weight cache: the artifact is not staged and the
        engine cannot fetch it itself (or the cache fetches it right now). Then a helper waits
        for it and posts "staged"; the phase stays, with the Staging condition and progress."""
        stager = self._deps.stager
        if stager is None:
            return False
        self._model_path = stager.model_path(self.spec)
        if self._model_path is not None or not stager.must_stage(self.spec):
            return False
        self._stage_token += 1
        token, post = self._stage_token, self._inbox.put_nowait

        async def stage() -> None:
            try:
                path, error = await stager.stage(
                    self.spec, lambda view: post(("staging", token, view))), None
            except StagingFailed as exc:
                path, error = None, str(exc)
            post(("staged", token, reason, path, error))

        self._helper(stage())
        return True

    async def _on_staging(self, kind: str, token: int, *rest: Any) -> None:
        waiting = self._proc is None and self.view.phase in (Phase.ACTIVATING, Phase.RESTARTING)
        if token != self._stage_token or not waiting:
            return  # stopped (or started otherwise) meanwhile
        if kind == "staging":
            self._staging = rest[0]
            self._emit("Staging", f"waiting for {self.spec.artifact_url} in the weight cache")
            return
        reason, path, error = rest
        self._staging = None
        if path is not None:
            await self._spawn(reason)
            return
        self.record.last_error = f"staging {self.spec.artifact_url} failed: {error}"
        self._deps.memory.stopped(self.name)
        await self._transition(Phase.FAILED, "StagingFailed", self.record.last_error)
        if not self.spawned.done():
            self.spawned.set_result(self.record.last_error)

    # ---- intents --------------------------------------------------------------------------

    async def _on_intent(self, intent: Intent, future: asyncio.Future[OpResult]) -> None:
        if intent.action == "stop":
            await self._stop(future)
            return
        if intent.operation_id and intent.operation_id in self.record.operations:
            _resolve(future, OpResult(200, self.record.operations[intent.operation_id]))
            return
        if intent.action == "kv_limit":
            await self._set_kv_limit(intent, future)
            return
        if self._op is not None:
            self._deferred.append((intent, future))
            return
        phase = self.view.phase
        want_sleep = intent.action == "sleep"
        if (want_sleep and phase is Phase.SLEEPING) or (not want_sleep and phase is Phase.ACTIVE):
            _resolve(future, OpResult(200, self._op_body(intent, applied=False)))
            return
        if phase not in (Phase.ACTIVE, Phase.SLEEPING):
            _resolve(future, OpResult.error(
                409, f"model {self.name!r} is {phase.value}; it can {intent.action} once it is "
                "active or sleeping", phase=phase.value))
            return
        if want_sleep and (why := self._adapter.sleep_unsupported()) is not None:
            _resolve(future, OpResult.error(409, f"model {self.name!r} cannot sleep: {why}",
                                            phase=phase.value))
            return
        level = intent.level if want_sleep else (self.record.sleep_level or 1)
        memory = self._deps.memory
        refused = memory.admit_sleep(self.name, level) if want_sleep else None
        if not want_sleep:
            claimed = memory.claim_wake(self.name)
            refused = claimed if isinstance(claimed, Refuse) else None
        if refused is not None:
            _resolve(future, OpResult.error(
                409, f"model {self.name!r} cannot {intent.action} now: {refused.message}",
                reason=refused.reason, phase=phase.value, needed_bytes=refused.needed,
                free_bytes=refused.free,
                holders=[{"model_name": k, "bytes": b} for k, b in refused.holders]))
            return
        self._start_op(intent.action, level, intent, future)

    def _start_op(self, action: str, level: int, intent: Intent | None,
                  future: asyncio.Future[OpResult] | None) -> None:
        gen = self._gen
        started = time.monotonic()

        memory = self._deps.memory
        if action == "sleep":
            memory.set_sleeping(self.name, True)  # figures from here on are not its awake size

        async def run() -> None:
            error: str | None = None
            try:
                if action == "sleep":
                    await self._adapter.sleep(level, self._settings.lifecycle_timeout_s)
                else:
                    async with memory.gate.turn(self.record.devices):
                        await self._adapter.wake(level, self._settings.lifecycle_timeout_s)
            except EngineCallError as exc:
                error = str(exc)
            sleeping = await self._adapter.is_sleeping(self._settings.probe_timeout_s)
            self._inbox.put_nowait(("op_done", gen, action, level, error, sleeping, intent, future,
                                    time.monotonic() - started))

        task = asyncio.create_task(run(), name=f"{action}:{self.name}")
        self._op = (task, action, future)
        self._publish()

    async def _on_op_done(self, action: str, level: int, error: str | None,
                          sleeping: bool | None, intent: Intent | None,
                          future: asyncio.Future[OpResult] | None, seconds: float) -> None:
        self._op = None
        want_sleeping = action == "sleep"
        if sleeping is None:  # no confirmation: trust the call's own result
            sleeping = want_sleeping if error is None else not want_sleeping
        ok = error is None and sleeping == want_sleeping
        if not sleeping:
            self._deps.memory.set_sleeping(self.name, False)
        if not ok and not want_sleeping:
            self._deps.memory.release_claim(self.name)
        if ok:
            self.record.desired = "asleep" if want_sleeping else "awake"
            self.record.sleep_level = level if want_sleeping else None
        self.record.count_operation(action, "success" if ok else "failure")
        target = Phase.SLEEPING if sleeping else Phase.ACTIVE
        reason = ("Slept" if want_sleeping else "Woken") if ok else f"{action.capitalize()}Failed"
        detail = f"{action} took {seconds:.3f} s" if ok else (error or f"engine did not {action}")
        if target is not self.view.phase:
            await self._transition(target, reason, detail, persist=False, duration_s=seconds)
        else:
            self._emit(reason, detail, to=target, duration_s=seconds)
        if intent is not None and future is not None:
            if ok:
                body = self._op_body(intent, applied=True)
                if intent.operation_id:
                    self.record.remember_operation(intent.operation_id, body)
                await self._persist()
                _resolve(future, OpResult(200, body))
            else:
                await self._persist()
                _resolve(future, OpResult.error(
                    502, f"{action} of {self.name!r} failed: {detail}", phase=target.value,
                    operation_id=intent.operation_id, applied=False))
        else:
            await self._persist()
        while self._deferred and self._op is None:
            await self._on_intent(*self._deferred.popleft())

    async def _set_kv_limit(self, intent: Intent, future: asyncio.Future[OpResult]) -> None:
        phase = self.view.phase
        if phase in (Phase.FAILED, Phase.STOPPING, Phase.STOPPED):
            _resolve(future, OpResult.error(409, f"model {self.name!r} is {phase.value}; its KV "
                                            "limit cannot be set", phase=phase.value))
            return
        detail = await self._kv.request(intent.limit_bytes)
        body = {"status": "success", "model_name": self.name,
                "operation_id": intent.operation_id, "phase": phase.value, **detail}
        if detail["applied"] and intent.operation_id:
            self.record.remember_operation(intent.operation_id, body)
        await self._persist()
        self._publish()
        _resolve(future, OpResult(200, body))

    def _op_body(self, intent: Intent, applied: bool) -> dict[str, Any]:
        return {"status": "success", "model_name": self.name, "operation_id": intent.operation_id,
                "applied": applied, "phase": self.view.phase.value}

    def _fail_op(self, why: str) -> None:
        """Cancel the operation in flight and answer everyone waiting on one: ``why``."""
        waiting = [future for _, future in self._deferred]
        self._deferred.clear()
        if self._op is not None:
            task, _, future = self._op
            task.cancel()
            self._op = None
            if future is not None:
                waiting.insert(0, future)
        for future in waiting:
            _resolve(future, OpResult.error(409, f"{why}; try again", phase=self.view.phase.value))

    async def _stop(self, future: asyncio.Future[OpResult]) -> None:
        if self._restart_timer is not None:
            self._restart_timer.cancel()
            self._restart_timer = None
        self._cancel_helpers()
        self._fail_op(f"model {self.name!r} is being stopped")
        await self._transition(Phase.STOPPING, "Deactivate", "stop requested")
        proc, self._proc = self._proc, None
        self._gen += 1
        if proc is not None:
            info = await proc.stop(self._settings.stop_grace_s)
            detail = info.describe()
        else:
            detail = "no process was running"
        self.record.pid = self.record.pid_start_time = None
        if not self.spawned.done():
            self.spawned.set_result("deactivated before it started")
        self._end_turn()
        self._deps.memory.stopped(self.name)
        await self._kv.remove_leftover()
        await self._transition(Phase.STOPPED, "Stopped", detail, persist=False)
        await asyncio.to_thread(self._deps.store.delete, self.record.engine_id)
        await self._adapter.close()
        _resolve(future, OpResult(200, {"status": "success", "model_name": self.name,
                                        "phase": Phase.STOPPED.value, "message": detail}))
        while not self._inbox.empty():  # intents that raced with the stop
            message = self._inbox.get_nowait()
            if message[0] == "intent":
                _resolve(message[2], OpResult.error(404, f"model {self.name!r} was stopped"))

    # ---- state changes --------------------------------------------------------------------

    async def _transition(self, to: Phase, reason: str, message: str,
                          persist: bool = True, duration_s: float | None = None) -> None:
        src = self.view.phase
        if to is not src:
            check_transition(src, to)
            self.record.phase = to.value
            self.record.last_transition = self._deps.clock()
            self._publish()
            self._emit(reason, message, src=src, to=to, duration_s=duration_s)
        if persist and to is not Phase.STOPPED:
            await self._persist()

    async def _persist(self) -> None:
        self._kv.persist_into(self.record)
        snapshot = self.record.model_copy(deep=True)
        await asyncio.to_thread(self._deps.store.save, snapshot)  # fsync: off the event loop

    def _emit(self, reason: str, message: str, src: Phase | None = None,
              to: Phase | None = None, duration_s: float | None = None) -> None:
        self._deps.on_event(EngineEvent(
            at=self._deps.clock(), model_name=self.name, engine_id=self.record.engine_id,
            src=(src or self.view.phase).value, dst=(to or self.view.phase).value,
            reason=reason, message=message, duration_s=duration_s))

    def _publish(self) -> None:
        self.view = self._make_view()
        self._deps.on_view(self.view)

    def _make_view(self) -> EngineView:
        r, f = self.record, self._figures
        return EngineView(
            engine_id=r.engine_id, spec=r.spec, port=r.port, phase=Phase(r.phase), pid=r.pid,
            alive=self._proc is not None, ready=self._ready and r.phase == Phase.ACTIVE.value,
            adopted=self._adopted, desired=r.desired, sleep_level=r.sleep_level,
            operation=self._op[1] if self._op else None, restart_count=r.restart_count,
            last_error=r.last_error, last_transition=r.last_transition, created_at=r.created_at,
            requests_running=f.running if f else None, requests_waiting=f.waiting if f else None,
            request_success_total=f.success_total if f else None, figures_at=self._figures_at,
            observed_footprint_bytes=f.footprint_bytes if f else None,
            context_length=f.context_length if f else None,
            log_path=str(self.log_path), op_counts=dict(r.op_counts),
            budget_exhausted=r.budget_exhausted, kv=self._kv.state, devices=tuple(r.devices),
            staging=self._staging,  # issue 14 hook
        )

    def _helper(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)

    def _cancel_helpers(self) -> None:
        for task in list(self._helpers):
            task.cancel()
        self._helpers.clear()


def _resolve(future: asyncio.Future[OpResult], result: OpResult) -> None:
    if not future.done():
        future.set_result(result)
