"""The engine owner: one asyncio task per engine that alone changes that engine's state.

API handlers send the owner an intent (sleep, wake, stop, a KV limit) and await its outcome;
everything the engine does on its own (exits, becomes ready, answers or misses a health probe,
reports request figures) reaches the owner as an event in the same inbox. Messages are typed
(``runtime_agent.supervision.messages``) and handled one at a time, so every decision that
leads to a start, stop, sleep or wake is made with the owner's own, current state. Long work
(a 10 s sleep call, probing, scraping: ``runtime_agent.supervision.watchers``) runs in helper
tasks that post their results back, so the owner keeps answering (a stop, an exit) while an
engine call is in flight. No lock exists. Sleep, wake and KV-limit intents are handled by
``runtime_agent.supervision.intents``.

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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from contract.phases import Phase, check_transition
from contract.reasons import (
    ENGINE_UNRESPONSIVE,
    KV_LIMIT_NOT_HELD,
    KV_SEGMENT_MISSING,
    PORT_HELD,
    RESTART_BUDGET_EXHAUSTED,
    START_FAILED,
    START_QUEUED,
    STORAGE_UNAVAILABLE,
)
from engines.adapter import EngineAdapter, Observation
from engines.process import (
    EngineProcess,
    ExitInfo,
    ProcessLauncher,
    SpawnError,
    group_workers,
    tail_lines,
)
from registry import stops
from registry.record import EngineRecord, EngineSpec
from registry.store import RegistryStore
from runtime_agent.artifacts.staging import EngineStager, StagingView
from runtime_agent.cadence import Pacer
from runtime_agent.gpu.broker import MemoryBroker
from runtime_agent.gpu.gate import Turn
from runtime_agent.kv.keeper import KvKeeper
from runtime_agent.loops import Throttled, keep_running
from runtime_agent.settings import Settings
from runtime_agent.supervision import (
    adapters,
    durability,
    health,
    intents,
    staging,
    watchers,
)
from runtime_agent.supervision.backoff import restart_delay
from runtime_agent.supervision.durability import StorageHealth
from runtime_agent.supervision.engine_kinds import engine_command, simulated
from runtime_agent.supervision.intents import resolve
from runtime_agent.supervision.messages import (
    AdapterDone,
    AdaptersSynced,
    Exited,
    Figures,
    FromProcess,
    Health,
    Intent,
    KvReading,
    Message,
    OpDone,
    PersistDue,
    Ready,
    Request,
    RestartDue,
    SpawnRetry,
    Staged,
    StagingProgress,
    StartMode,
    Stop,
    TurnGranted,
    Unusable,
)
from runtime_agent.supervision.outcomes import EngineFailed, NotFound, Outcome
from runtime_agent.supervision.ports import lost_its_port, port_is_free
from runtime_agent.supervision.views import EngineEvent, EngineView

log = logging.getLogger(__name__)

# How long an activation whose weights are being staged waits for the staging's end before it is
# answered `activating` (a start waiting for its card or its port is answered at once).
STAGING_ANSWER_S = 2.0


@dataclass(frozen=True)
class OwnerDeps:
    settings: Settings
    store: RegistryStore
    launcher: ProcessLauncher
    adapter_for: Callable[[EngineRecord], EngineAdapter]
    on_event: Callable[[EngineEvent], None]
    on_view: Callable[[EngineView], None]
    memory: MemoryBroker
    clock: Callable[[], float] = time.time
    port_free: Callable[[int, str], bool] = port_is_free
    stager: EngineStager | None = None  # the weight cache (None: off); see staging.py
    storage: StorageHealth = field(default_factory=StorageHealth)  # shared by every owner
    throttled: Throttled = field(default_factory=lambda: Throttled(log))


class EngineOwner:
    def __init__(self, record: EngineRecord, deps: OwnerDeps) -> None:
        self.record = record
        self._deps = deps
        self._settings = deps.settings
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._adapter = deps.adapter_for(record)
        self._exit_cause: str | None = None  # why the agent itself killed the process
        self._proc: EngineProcess | None = None
        self._gen = 0  # bumps with every process; events from older processes are dropped
        self._helpers: set[asyncio.Task[None]] = set()
        # The sleep or wake in flight: its task, action and the request waiting for it (if any).
        self._op: tuple[asyncio.Task[None], str, Request | None] | None = None
        self._deferred: deque[Request] = deque()
        self._restart_timer: asyncio.TimerHandle | None = None
        self._turn: Turn | None = None  # the turn on its cards this start holds or waits for
        self._turn_token = 0
        self._ready = False
        self._adopted = False
        self._converge = True  # after a spawn, steer the engine to the desired sleep state
        self._figures: Observation | None = None
        self._figures_at: float | None = None
        self._adapters_loaded: set[str] = set()  # LoRA adapters the current process serves
        # The weight cache's copy the engine starts on, and the staging it waits for.
        self._model_path: str | None = None
        self._staging: StagingView | None = None
        self._stage_token = 0
        self._unresponsive_since: float | None = None  # health probes unanswered since
        # The paces of the health probe, the scrape and the KV check: fast after any event
        # (each nudged by ``_changed``), backing off while nothing changes (runtime_agent.cadence).
        self._health_pace = Pacer(self._settings.health_cadence)
        self._scrape_pace = Pacer(self._settings.scrape_cadence)
        self._kv_pace = Pacer(self._settings.kv_hold_cadence)
        self._throttled = deps.throttled
        self._persist_pending = False  # a retry of a failed record write is scheduled
        self._persist_retry_s = 0.0
        self._port_retry_s = 0.0
        self.spawned: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        # Done once an activation can be answered: the process started (None) or could not
        # (why), or the start waits (for its turn on its cards, the weight cache, its port),
        # which the view says. An activation answers then, never later (issue 26).
        self.answered: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.spawned.add_done_callback(lambda f: self._answer(f.result()))
        # Done once the engine's first state is known: ready, gone, failed or stopped.
        self.settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.log_path = self._settings.logs_dir / f"{record.engine_id}.log"
        self._kv = KvKeeper(record, self._settings.kv_shm_dir, lambda reason, message:
                            self._emit(reason, message))
        self.view = self._make_view()
        self._task: asyncio.Task[None] | None = None

    # ---- public surface -------------------------------------------------------------------

    def start(self, mode: StartMode, pid: int | None = None) -> None:
        """Run the owner; ``mode`` says what the pool or the recovery found."""
        if mode is StartMode.ADOPT:  # the recovery verified the process: readers know it at once
            self._adopted = True
            self.view = self._make_view()
        self._task = asyncio.create_task(self._run(mode, pid), name=f"owner:{self.name}")

    @property
    def finished(self) -> asyncio.Task[None]:
        """The owner's task: done once its engine is stopped (or the agent shuts down)."""
        assert self._task is not None, "start() first"
        return self._task

    @property
    def name(self) -> str:
        return self.record.spec.model_name

    @property
    def spec(self) -> EngineSpec:
        return self.record.spec

    async def request(self, intent: Intent) -> Outcome:
        if self._task is None or self._task.done():
            return NotFound(self.name, f"model {self.name!r} is not running on this agent")
        reply: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(Request(intent, reply))
        return await reply

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

    async def _run(self, mode: StartMode, pid: int | None) -> None:
        try:
            await self._begin(mode, pid)
            if mode is not StartMode.SPAWN and not self.spawned.done():
                self.spawned.set_result(None)
            self._publish()  # readers see the start-up's outcome (adopted, say) at once
            if self.view.phase in (Phase.FAILED, Phase.RESTARTING):
                self._settle()
            while self.view.phase is not Phase.STOPPED:
                message = await self._inbox.get()
                try:
                    await self._handle(message)
                except Exception as exc:  # noqa: BLE001 - one message must not end supervision
                    self._failed_handling(message, exc)
                self._publish()
                if self.view.phase not in (Phase.ACTIVATING, Phase.BOOTING):
                    self._settle()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: record it where an operator looks, keep the agent alive
            log.exception("owner of %s crashed", self.name)
            self.record.last_error = "agent error while supervising this engine (see agent log)"
            self._publish()
            raise
        finally:  # nobody waits for an answer that can no longer come
            self._answer(self.record.last_error or "its supervision ended before it started")

    def _failed_handling(self, message: Message, exc: Exception) -> None:
        """A message could not be handled (a bug, or a fault such as no file descriptors): the
        owner keeps supervising, its caller gets an answer, and the log says it once."""
        if self._throttled.warning(f"owner:{self.name}:{type(message).__name__}",
                                   "owner of %s could not handle %s: %s: %s", self.name,
                                   type(message).__name__, type(exc).__name__, exc):
            log.debug("the failure in full", exc_info=exc)
        if isinstance(message, Request):
            resolve(message.reply, EngineFailed(self.name, f"the agent failed handling this "
                                                f"({type(exc).__name__}: {exc}); try again",
                                                self.view.phase, message.intent.operation_id))

    async def _begin(self, mode: StartMode, pid: int | None) -> None:
        match mode:
            case StartMode.ADOPT if pid is not None:
                await self._adopt(pid)
            case StartMode.RESTART if self.record.pid is None and self.record.phase in (
                    Phase.ACTIVATING, Phase.RESTARTING):
                # No process of it ever ran under the previous agent's eyes: that agent died
                # before the start, or while a restart it had already counted was due. The
                # start it owed is made now and counts nothing: an agent's restart never
                # spends an engine's restart budget.
                await self._spawn("activated" if self.record.phase is Phase.ACTIVATING
                                  else f"restart {self.record.restart_count}")
            case StartMode.RESTART:
                await self._after_exit(None, "its process was gone when the agent started",
                                       restart_now=True)
            case StartMode.STOP:  # the previous agent died while stopping this engine
                if pid is not None and (proc := self._deps.launcher.attach(pid)) is not None:
                    self._proc = proc
                reply: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
                self._inbox.put_nowait(Request(Stop(), reply))
            case StartMode.SPAWN:
                if await self._persist():  # the record is durable before any process starts
                    await self._spawn("activated")
                else:
                    self.record.last_error = ("cannot start: its record cannot be written "
                                              f"({self._deps.storage.problem})")
                    await self._transition(Phase.FAILED, STORAGE_UNAVAILABLE,
                                           self.record.last_error, persist=False)
                    self._deps.memory.stopped(self.name)
                    if not self.spawned.done():
                        self.spawned.set_result(self.record.last_error)

    async def _handle(self, message: Message) -> None:
        if isinstance(message, FromProcess) and message.gen != self._gen:
            return  # from a process that is gone
        match message:
            case Request():
                self._changed()  # an intent (a KV limit, a sleep...): look closely again
                await intents.on_request(self, message)
            case StagingProgress():
                staging.on_progress(self, message)
            case Staged():
                await staging.on_staged(self, message)
            case TurnGranted(token=token, reason=reason):
                if token != self._turn_token:
                    pass  # a turn given back already; the current one is another's
                elif self._proc is None and self.view.phase in (Phase.ACTIVATING,
                                                                Phase.RESTARTING):
                    await self._spawn_now(reason)
                else:
                    self._end_turn()
            case Exited(info=info):
                await self._after_exit(info, None)
            case Unusable(why=why):  # stuck or unloadable: end this process; the exit decides
                self._exit_cause = why
                if self._proc is not None:
                    self._proc.signal_group(signal.SIGKILL)
            case Ready(sleeping=sleeping):
                await self._on_ready(sleeping)
            case Health():
                await health.on_health(self, message)
            case PersistDue():
                await durability.on_persist_due(self)
            case SpawnRetry(reason=reason):
                if self._proc is None and self.view.phase in (Phase.ACTIVATING,
                                                              Phase.RESTARTING):
                    await self._spawn(reason)
            case KvReading(info=info, writes=writes):
                kv_before = self._kv.state
                if await self._kv.reading(info, writes):
                    await self._persist()
                if self._kv.state != kv_before:  # its use moved, a write, a loss
                    self._changed()
            case Figures(observation=observation):
                if observation != self._figures:  # requests came or went
                    self._changed()
                self._figures, self._figures_at = observation, self._deps.clock()
                await health.on_sleep_level(self, observation.sleep_level)
            case OpDone():
                await intents.on_op_done(self, message)
            case AdapterDone():
                await adapters.on_adapter_done(self, message)
            case AdaptersSynced():
                adapters.on_synced(self, message)
            case RestartDue():
                self._restart_timer = None
                if self.view.phase is Phase.RESTARTING:
                    await self._spawn(f"restart {self.record.restart_count}")

    # ---- process lifecycle ----------------------------------------------------------------

    async def _spawn(self, reason: str) -> None:
        """Start the engine once it has its turn on its cards (``runtime_agent.gpu.gate``): an
        engine that declared its footprint shares the turn with other declared starts there
        (the ledger set its bytes aside), one that is measured has its cards alone. The turn
        is held until the engine answers (or its start ends otherwise)."""
        if staging.stage_first(self, reason):  # weights first (the cache), then the turn
            # A staging that fails does so fast (403, no such object): its caller hears it in
            # the answer; one that takes longer is answered `activating` (Staging) meanwhile.
            asyncio.get_running_loop().call_later(STAGING_ANSWER_S, self._answer, None)
            return
        self._end_turn()
        self._turn_token += 1
        token = self._turn_token
        turn = self._deps.memory.gate.request(self.record.devices, label=self.name,
                                              shared=self.record.per_gpu is not None)
        self._turn = turn
        if turn.granted.done():  # nothing conflicts on its cards: start now
            await self._spawn_now(reason)
            return
        self._emit(START_QUEUED, self._queued_because(turn))
        self._answer(None)  # the activation answers now: queued, and why (StartQueued)

        def granted(fut: asyncio.Future[None]) -> None:
            if not fut.cancelled():
                self._inbox.put_nowait(TurnGranted(token, reason))

        turn.granted.add_done_callback(granted)

    def _queued_because(self, turn: Turn) -> str:
        cards = ", ".join(str(d) for d in self.record.devices)
        holders = self._deps.memory.gate.holders(self.record.devices)
        measured = [repr(name) for name, exclusive in holders if exclusive]
        if measured:
            why = f"{', '.join(measured)} is starting there and is measured alone"
        elif turn.exclusive:
            why = (f"it declared no per_gpu footprint, so it is measured alone once the "
                   f"{len(holders)} start(s) there are done")
        else:
            why = "a measured start waits there before it"
        return f"waiting for its turn on GPU {cards}: {why}"

    def _end_turn(self) -> None:
        if self._turn is not None:
            self._turn.release()
            self._turn = None

    def _answer(self, error: str | None) -> None:
        if not self.answered.done():
            self.answered.set_result(error)

    async def _spawn_now(self, reason: str) -> None:
        spec = self.record.spec
        if not self._deps.port_free(self.record.port, self._settings.engine_bind_host):
            # The engine keeps its port for life; another process holds it. Wait for it with
            # a growing pause, as the kubelet does: a restart would only burn the budget.
            self._end_turn()
            first = self._port_retry_s == 0
            self._port_retry_s = min(30.0, max(1.0, self._port_retry_s * 2))
            self.record.last_error = (f"port {self.record.port} is held by another process, so "
                                      "the engine cannot listen on it; waiting for it")
            if first:
                self._emit(PORT_HELD, f"{self.record.last_error}; trying again in "
                           f"{self._port_retry_s:g} s and growing")
            self._answer(None)  # waiting for its port: the view says so (PortHeld)
            asyncio.get_running_loop().call_later(self._port_retry_s, self._inbox.put_nowait,
                                                  SpawnRetry(self._gen, reason))
            return
        self._port_retry_s = 0.0
        try:
            argv, env = engine_command(self._settings, self.record, self._adapter,
                                       model_path=self._model_path)
            spawned_at = time.time()
            proc = await self._deps.launcher.spawn(argv, env, self.log_path)
        except (SpawnError, ValueError, OSError) as exc:
            self.record.last_error = f"cannot start engine: {exc}"
            self._end_turn()
            self._deps.memory.stopped(self.name)
            await self._transition(Phase.FAILED, START_FAILED, self.record.last_error)
            if not self.spawned.done():
                self.spawned.set_result(self.record.last_error)
            return
        self._kv.new_process(spawned_at)
        # Ollama loads its model after the server starts; not when it is meant to sleep.
        self._attach(proc, prepare=self.record.desired == "awake" or self.spec.engine != "ollama")
        self.record.pid, self.record.pid_start_time = proc.pid, proc.start_time
        self._converge = True
        await self._transition(Phase.BOOTING, reason, f"pid {proc.pid} on port {self.record.port}")
        if not self.spawned.done():
            self.spawned.set_result(None)
        log.info("engine %s started: pid %d port %d (%s)%s", spec.model_name, proc.pid,
                 self.record.port, reason, f"; SIMULATED {spec.engine} (python -m engines.sim)"
                 if simulated(self._settings, spec) else "", extra={"model": spec.model_name})

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
        self._adapters_loaded = set()
        self._unresponsive_since = None

        def exited(fut: asyncio.Future[ExitInfo]) -> None:
            if not fut.cancelled():
                self._inbox.put_nowait(Exited(gen, fut.result()))

        proc.exited.add_done_callback(exited)
        post = self._inbox.put_nowait
        asleep = self.record.phase is Phase.SLEEPING  # a re-adopted engine that was asleep
        self._helper(watchers.probe_ready(self._adapter, self._settings, post, gen, prepare,
                                          asleep))
        self._helper(watchers.watch_progress(self.log_path, self._settings, post, gen,
                                             lambda: self._ready))
        self._loop("KV-limit holding", lambda: self._kv.watch(
            lambda info, writes: self._inbox.put_nowait(KvReading(gen, info, writes)),
            self._settings.kv_watch_s, self._kv_pace, lambda: self._ready))

    async def _after_exit(self, info: ExitInfo | None, why: str | None,
                          restart_now: bool = False) -> None:
        """The engine's process is gone without being asked to stop: restart it or fail it.

        The decision and its transition come first, written to the record at once (an agent
        killed next must find the exit, not the dead pid); the leftover segment, the log tail
        and the record again follow (the tail before the move, for a terminal failure). A
        restart that falls due meanwhile waits in the inbox until this returns."""
        was_ready = self._ready
        self._cancel_helpers()
        self._end_turn()
        self._gen += 1  # results already queued by the dead process's helpers are void
        intents.fail_op(self, "the engine exited during the operation")
        self._proc, self._ready, self._figures = None, False, None
        self._adapters_loaded = set()
        self._unresponsive_since = None
        self.record.healthy_since = None  # a crash: the budget's clock starts again
        cause = why or (info.describe() if info else "exited")
        if self._exit_cause is not None:
            cause, self._exit_cause = f"{self._exit_cause} (then {cause})", None
        self.record.last_error = self.record.last_exit = cause
        self.record.pid = self.record.pid_start_time = None
        delay = restart_delay(self.record.restart_count, self._settings.restart_delays)
        if not was_ready and info is not None and await self._port_was_taken():
            # Not a crash: a stranger bound the port after our check. Start again at once; the
            # start waits for the port (PortHeld) while it is held. No restart is spent.
            self._deps.memory.exited(self.name)
            await self._transition(Phase.RESTARTING, PORT_HELD, f"port {self.record.port} was "
                                   "taken by another process before the engine bound it")
            self._restart_timer = asyncio.get_running_loop().call_later(
                0, self._inbox.put_nowait, RestartDue(self._gen))
        elif delay is None:  # terminal: no hurry; the log tail belongs in last_error at once,
            await self._add_log_tail(cause)  # and `failed` is read as "nothing of it is left"
            await self._kv.remove_leftover()
            self.record.budget_exhausted += 1
            self._deps.memory.stopped(self.name)
            msg = f"{cause}; restart budget of {len(self._settings.restart_delays)} spent"
            await self._transition(Phase.FAILED, RESTART_BUDGET_EXHAUSTED, msg, persist=False)
        else:
            self._deps.memory.exited(self.name)
            if restart_now:
                delay = 0.0  # the agent was down for longer than any backoff already
            self.record.restart_count += 1  # counted when scheduled, as AIBrix reads it
            # written at once: an agent killed before the log tail is read must leave the
            # exit on disk, not the dead pid (the next agent would call it "gone at start")
            await self._transition(Phase.RESTARTING, "Exited", f"{cause}; restart in {delay:g} s")
            self._restart_timer = asyncio.get_running_loop().call_later(
                delay, self._inbox.put_nowait, RestartDue(self._gen))
            await self._add_log_tail(cause)
        await self._kv.remove_leftover()
        # Its group died with its leader; helpers that left the group die now (by engine id).
        await asyncio.to_thread(self._deps.launcher.kill_leftovers,
                                str(self._settings.state_dir), self.record.engine_id)
        await self._persist()
        self._publish()  # the log tail, now on disk

    async def _port_was_taken(self) -> bool:
        tail = await asyncio.to_thread(tail_lines, self.log_path, 20)  # blocking file read
        return lost_its_port(tail, self.record.port)

    async def _add_log_tail(self, cause: str) -> None:
        """The exit's log tail joins ``last_exit`` in the record; the view shows it once the
        record is written (the exit handler's last step), never before: a reader must not see
        a tail that an agent killed now would not find on disk."""
        tail = await asyncio.to_thread(tail_lines, self.log_path, 20)  # blocking file read
        if tail:
            self.record.last_exit = cause + "\n" + "\n".join(tail)
            if self.record.last_error == cause:  # still the current error (not ready again)
                self.record.last_error = self.record.last_exit

    async def _on_ready(self, sleeping: bool | None) -> None:
        self._ready = True
        if self.record.last_error is not None:  # healthy again: an exit stays in last_exit
            self.record.last_error = None
            self._publish()
        if sleeping is None:  # the engine does not say (SGLang): a new process is awake, a
            sleeping = self._adopted and self.record.phase is Phase.SLEEPING  # re-adopted as recorded
        target = Phase.SLEEPING if sleeping else Phase.ACTIVE
        # The engine's own word: a re-adopted engine may have finished a sleep its record
        # never saw (the agent died during the call), and the ledger must charge it so.
        self._deps.memory.set_sleeping(self.name, target is Phase.SLEEPING)
        if self._adopted and not self._converge:  # before the move: its view says it all
            health.settle_operation(self, sleeping)  # a call the old agent left in flight
        if self._adopted and not self._converge and self.record.operation is None:
            self.record.desired = "asleep" if sleeping else "awake"
            if sleeping and self.record.sleep_level is None:
                self.record.sleep_level = 2  # unknown: wake it the way that reloads weights
        if target is self.view.phase:  # a re-adopted engine: no move, but followers learn it
            self._emit("Ready", "re-adopted engine answers /health", to=target)
            # and readers with them: the move's write below is not waited for (no phase is
            # told before the disk has it), so 32 such writes queued behind each other on the
            # thread pool no longer hold back 32 ready views (issue 26)
            self._publish()
        if self.record.healthy_since is None:
            self.record.healthy_since = self._deps.clock()
        await self._transition(target, "Ready", "answers /health")
        self._end_turn()  # after its event: the next start on its cards is told after it
        # Readers learn what the move wrote now, not after the workers' /proc scan below: 32
        # engines re-adopted at once are 32 scans of every process queued on the default
        # thread pool (issue 26). A worker that ends meanwhile is found all the same.
        self._publish()
        await self._watch_workers()
        gen, post = self._gen, self._inbox.put_nowait
        self._loop("request-figure scrape", lambda: watchers.scrape(
            self._adapter, self._settings, post, gen, self._scrape_pace))
        self._loop("health probe", lambda: watchers.watch_health(
            self._adapter, self._settings, post, gen,
            lambda: self.view.phase is Phase.SLEEPING, lambda: self._op is not None,
            self._health_pace))
        if self._converge and self.record.desired == "asleep" and target is Phase.ACTIVE:
            await intents.sleep_after_restart(self)  # its adapters come back when it is woken
        elif target is Phase.ACTIVE:
            adapters.sync_after_ready(self)

    async def _watch_workers(self) -> None:
        """An engine is its whole process group: a worker that dies (vLLM's EngineCore) while
        the API server lives makes the engine unusable, so it is treated as a crash."""
        proc, gen = self._proc, self._gen
        if proc is None or not hasattr(proc, "watch_workers"):
            return
        workers = await asyncio.to_thread(group_workers, proc.pid)  # blocking /proc reads

        def ended(pid: int, name: str) -> None:
            self._inbox.put_nowait(Unusable(gen, f"its worker {name} (pid {pid}) exited while "
                                            "its API server lived"))

        if self._proc is proc:
            proc.watch_workers(workers, ended)

    # ---- stopping -------------------------------------------------------------------------

    async def _stop(self, request: Request) -> None:
        if not await durability.stop_is_durable(self):
            resolve(request.reply, self._deps.storage.refusal(self.name)
                    or NotFound(self.name, "unreachable"))
            return
        if self._restart_timer is not None:
            self._restart_timer.cancel()
            self._restart_timer = None
        self._cancel_helpers()
        intents.fail_op(self, f"model {self.name!r} is being stopped")
        await self._transition(Phase.STOPPING, "Deactivate", "stop requested", persist=False)
        proc, self._proc = self._proc, None
        self._gen += 1
        if proc is not None:
            info = await proc.stop(self._settings.stop_grace_s)
            detail = info.describe()
        else:
            detail = "no process was running"
        await asyncio.to_thread(self._deps.launcher.kill_leftovers,
                                str(self._settings.state_dir), self.record.engine_id)
        self.record.pid = self.record.pid_start_time = None
        if not self.spawned.done():
            self.spawned.set_result("deactivated before it started")
        self._end_turn()
        self._deps.memory.stopped(self.name)
        await self._kv.remove_leftover(release_name=True)  # stopped for good: the name too
        await self._transition(Phase.STOPPED, "Stopped", detail, persist=False)
        try:
            await asyncio.to_thread(self._deps.store.delete, self.record.engine_id)
        except OSError as exc:  # the record says STOPPING, or a marker remembers the stop
            self._throttled.warning(f"delete:{self.name}", "record of stopped %s not removed: %s",
                                    self.name, exc)  # (registry.stops): the next agent ends it
        else:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(stops.clear, self._settings.kv_shm_dir,
                                        self.record.engine_id)
        self._deps.storage.failing.pop(self.record.engine_id, None)
        await self._adapter.close()
        resolve(request.reply, intents.done(self, Phase.STOPPED, request.intent, details={
            "message": detail}))
        while not self._inbox.empty():  # intents that raced with the stop
            message = self._inbox.get_nowait()
            if isinstance(message, Request):
                resolve(message.reply, NotFound(self.name, f"model {self.name!r} was stopped"))

    async def _revive(self, request: Request) -> None:
        """Activated again with its spec: a failed engine starts over with a fresh restart
        budget (what it failed with stays in the event log); any other phase changes nothing."""
        if self.view.phase is not Phase.FAILED:
            resolve(request.reply, intents.done(self, self.view.phase, request.intent,
                                                changed=False))
            return
        if (unwritable := self._deps.storage.refusal(self.name)) is not None:
            resolve(request.reply, unwritable)
            return
        failed_with = (self.record.last_error or "").splitlines()[:1]
        self.record.restart_count = 0
        await self._transition(Phase.RESTARTING, "Reactivated", "activated again after it "
                               f"failed ({failed_with[0] if failed_with else 'no error'}); "
                               "starting with a fresh restart budget")
        self._restart_timer = asyncio.get_running_loop().call_later(
            0, self._inbox.put_nowait, RestartDue(self._gen))
        resolve(request.reply, intents.done(self, Phase.RESTARTING, request.intent, details={
            "message": "it had failed; started again with a fresh restart budget"}))

    # ---- state changes --------------------------------------------------------------------

    async def _transition(self, to: Phase, reason: str, message: str,
                          persist: bool = True, duration_s: float | None = None) -> None:
        src = self.view.phase
        if to is not src:
            check_transition(src, to)
            self.record.phase = to
            self.record.last_transition = self._deps.clock()
        if persist and to is not Phase.STOPPED:  # on disk before anyone is told: an agent
            await self._persist()  # killed right after leaves what its readers saw
        if to is not src:
            self._publish()
            self._emit(reason, message, src=src, to=to, duration_s=duration_s)

    async def _persist(self) -> bool:
        """Write the record (fsync: off the event loop); False when the disk refused it, which
        is reported and retried (``durability``), never fatal."""
        self._kv.persist_into(self.record)
        self._peak_into(self.record)
        snapshot = self.record.model_copy(deep=True)
        try:
            await asyncio.to_thread(self._deps.store.save, snapshot)
        except OSError as exc:
            durability.write_failed(self, exc)
            return False
        durability.write_succeeded(self)
        return True

    def _peak_into(self, record: EngineRecord) -> None:
        """The HBM peak of the engine's process so far, kept with the record."""
        figures = self._deps.memory.figures.get(self.name)
        peak = figures.hbm_peak_bytes if figures is not None else None
        if record.pid is None or peak is None:
            return
        if record.hbm_peak_pid != record.pid:  # a new process: its own peak
            record.hbm_peak_pid, record.hbm_peak_bytes = record.pid, peak
        else:
            record.hbm_peak_bytes = max(peak, record.hbm_peak_bytes or 0)

    def _changed(self) -> None:
        """Something happened to the engine: its watchers look at the fast pace again."""
        for pace in (self._health_pace, self._scrape_pace, self._kv_pace):
            pace.nudge()

    def _emit(self, reason: str, message: str, src: Phase | None = None,
              to: Phase | None = None, duration_s: float | None = None) -> None:
        self._changed()  # every event (a transition, a KV limit set, a miss) is a change
        self._deps.on_event(EngineEvent(
            at=self._deps.clock(), model_name=self.name, engine_id=self.record.engine_id,
            src=(src or self.view.phase).value, dst=(to or self.view.phase).value,
            reason=reason, message=message, duration_s=duration_s))

    def _publish(self) -> None:
        view = self._make_view()
        if view != self.view:  # readers re-render only on a real change (snapshot ETags)
            self.view = view
            self._deps.on_view(view)

    def _make_view(self) -> EngineView:
        r, f = self.record, self._figures
        return EngineView(
            engine_id=r.engine_id, spec=r.spec, port=r.port, phase=r.phase, pid=r.pid,
            alive=self._proc is not None,
            ready=self._ready and r.phase is Phase.ACTIVE and self._unresponsive_since is None,
            adopted=self._adopted, desired=r.desired, sleep_level=r.sleep_level,
            operation=self._op[1] if self._op else None, restart_count=r.restart_count,
            last_error=r.last_error, last_transition=r.last_transition, created_at=r.created_at,
            requests_running=f.running if f else None, requests_waiting=f.waiting if f else None,
            request_success_total=f.success_total if f else None, figures_at=self._figures_at,
            observed_footprint_bytes=f.footprint_bytes if f else None,
            context_length=f.context_length if f else None,
            log_path=str(self.log_path), op_counts=dict(r.op_counts),
            budget_exhausted=r.budget_exhausted, kv=self._kv.state, devices=tuple(r.devices),
            adapters=tuple((a.name, a.path, a.name in self._adapters_loaded) for a in r.adapters),
            staging=self._staging, conditions=self._conditions(), last_exit=r.last_exit,
            simulated=simulated(self._settings, r.spec),
        )

    def _conditions(self) -> tuple[str, ...]:
        """What is wrong now, by the contract's reason names."""
        found = []
        if self._kv.state.not_held:
            found.append(KV_LIMIT_NOT_HELD)
        if self._kv.state.lost and self._proc is not None:
            found.append(KV_SEGMENT_MISSING)
        if self._unresponsive_since is not None:
            found.append(ENGINE_UNRESPONSIVE)
        if self.record.engine_id in self._deps.storage.failing:
            found.append(STORAGE_UNAVAILABLE)
        if self._port_retry_s:
            found.append(PORT_HELD)
        if self._turn is not None and not self._turn.granted.done():
            found.append(START_QUEUED)
        if self._staging is not None:
            found.append("Staging")
        return tuple(found)

    def _settle(self) -> None:
        if not self.settled.done():
            self.settled.set_result(None)

    def _loop(self, what: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """A watcher for this process's life, restarted if it fails (``loops.keep_running``)."""
        self._helper(keep_running(f"{what} of {self.name}", loop, self._throttled))

    def _helper(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)

    def _cancel_helpers(self) -> None:
        for task in list(self._helpers):
            task.cancel()
        self._helpers.clear()
