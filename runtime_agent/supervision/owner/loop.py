"""The engine owner's loop: one asyncio task per engine that alone changes that engine's state.

API handlers send the owner an intent (sleep, wake, stop, a KV limit) and await its outcome;
everything the engine does on its own (exits, becomes ready, answers or misses a health probe,
reports request figures) reaches the owner as an event in the same inbox. Messages are typed
(``runtime_agent.supervision.messages``) and handled one at a time, so every decision that
leads to a start, stop, sleep or wake is made with the owner's own, current state. Long work
(a 10 s sleep call, probing, scraping: ``runtime_agent.supervision.watchers``) runs in helper
tasks that post their results back, so the owner keeps answering (a stop, an exit) while an
engine call is in flight. No lock exists.

The loop is the only writer of the inbox, the phase and the view; the rest lives in parts that
keep their own fields (``slots``, ``liveness``, ``records``, ``weights``, ``turns``, ``lora``,
``intents``, ``observe``, ``promises``) and reach the loop through ``port.OwnerLoop`` only.
Starting the engine's process is ``life``; ending it, ``ends``. Time comes from the injected
clock (``deps.clock``).

Readers (the snapshot, the metrics) read ``owner.view``: an immutable value replaced on every
change.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from contract.clock import Clock
from contract.phases import Phase, check_transition
from engines.driver import Observation
from runtime_agent.cadence import Pacer
from runtime_agent.kv.keeper import KvKeeper
from runtime_agent.supervision.engine_kinds import simulated
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
    Revive,
    SpawnRetry,
    Staged,
    StagingProgress,
    StartMode,
    Stop,
    TurnGranted,
    Unusable,
)
from runtime_agent.supervision.outcomes import EngineFailed, NotFound, Outcome
from runtime_agent.supervision.owner.answers import resolve
from runtime_agent.supervision.owner.deps import OwnerDeps
from runtime_agent.supervision.owner.intents import Intents
from runtime_agent.supervision.owner.ends import EndParts, Ends
from runtime_agent.supervision.owner.life import Life, Parts
from runtime_agent.supervision.owner.liveness import Liveness
from runtime_agent.supervision.owner.look import FreshLook
from runtime_agent.supervision.owner.lora import Lora
from runtime_agent.supervision.owner.observe import Observer
from runtime_agent.supervision.owner.promises import Promises
from runtime_agent.supervision.owner.records import RecordWriter
from runtime_agent.supervision.owner.slots import OperationSlot, ProcessSlot
from runtime_agent.supervision.owner.weights import StagingSlot
from runtime_agent.supervision.owner.turns import TurnSlot
from runtime_agent.supervision.owner.view import Seen, make_view
from runtime_agent.supervision.views import EngineEvent, EngineView

if TYPE_CHECKING:
    from registry.record import EngineRecord, EngineSpec

log = logging.getLogger(__name__)


class EngineOwner:
    def __init__(self, record: EngineRecord, deps: OwnerDeps) -> None:
        self.record = record
        self._deps = deps
        s = self._settings = deps.settings
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._engine = deps.driver_for(record)
        self._helpers: set[asyncio.Task[None]] = set()
        self._figures: Observation | None = None
        self._figures_at: float | None = None
        # The paces of the health probe, the scrape and the KV check: fast after any event
        # (each nudged by ``_changed``), backing off while nothing changes (runtime_agent.cadence).
        self._paces = (Pacer(s.health_cadence, deps.clock), Pacer(s.scrape_cadence, deps.clock),
                       Pacer(s.kv_hold_cadence, deps.clock))
        self._throttled = deps.throttled
        self.log_path = s.logs_dir / f"{record.engine_id}.log"
        self._kv = KvKeeper(record, s.kv_shm_dir, lambda reason, message:
                            self.emit(reason, message), clock=deps.clock)
        # The parts: each keeps its own fields and reaches this loop through ``OwnerLoop``.
        self._procs = ProcessSlot()
        self._ops = OperationSlot()
        self._liveness = Liveness(s.unresponsive_after, s.unresponsive_grace_s)
        self._writer = RecordWriter(self, deps.store, deps.storage, deps.throttled)
        self._staging = StagingSlot(deps.stager, self.post)
        self._turns = TurnSlot(deps.memory.gate)
        self._lora = Lora(self, self._ops, self._procs, self._engine, deps.storage, s)
        self._intents = Intents(self, self._ops, self._lora, self._kv, self._engine,
                                deps.memory, deps.storage, s)
        self._observer = Observer(self, self._ops, self._procs, self._liveness, deps.memory, s)
        self._promises = Promises()
        self._ends = Ends(self, deps, self._engine, self._kv, self.log_path, EndParts(
            self._procs, self._liveness, self._writer, self._turns, self._lora, self._intents,
            self._promises), self._forget_figures)
        self._life = Life(self, deps, self._engine, self._kv, self.log_path, Parts(
            self._procs, self._liveness, self._staging, self._turns, self._lora,
            self._intents, self._observer, self._promises, self._ends), self._paces,
            self._forget_figures)
        self._look = FreshLook(self._engine, s.probe_timeout_s, self.post, lambda: self.generation)
        self.view = self._make_view()
        self._task: asyncio.Task[None] | None = None

    # ---- public surface -------------------------------------------------------------------

    def start(self, mode: StartMode, pid: int | None = None) -> None:
        """Run the owner; ``mode`` says what the pool or the recovery found."""
        if mode is StartMode.ADOPT:  # the recovery verified the process: readers know it at once
            self._life.adopted = True
            self.view = self._make_view()
        self._task = asyncio.create_task(self._run(mode, pid), name=f"owner:{self.name}")

    @property
    def started(self) -> bool:
        return self._task is not None

    @property
    def finished(self) -> asyncio.Task[None]:
        """The owner's task: done once its engine is stopped (or the agent shuts down)."""
        assert self._task is not None, "start() first"
        return self._task

    @property
    def spawned(self) -> asyncio.Future[str | None]:
        """Done once the first process started (None) or could not (why): ``promises``."""
        return self._promises.spawned

    @property
    def answered(self) -> asyncio.Future[str | None]:
        """Done once an activation can be answered (``promises``)."""
        return self._promises.answered

    @property
    def settled(self) -> asyncio.Future[None]:
        """Done once the engine's first state is known (``promises``)."""
        return self._promises.settled

    @property
    def kv(self) -> KvKeeper:
        """The KV-limit keeper of this engine (read its state; only the owner's task acts)."""
        return self._kv

    @property
    def name(self) -> str:
        return self.record.spec.model_name

    @property
    def spec(self) -> EngineSpec:
        return self.record.spec

    @property
    def phase(self) -> Phase:
        return self.view.phase

    @property
    def generation(self) -> int:
        return self._procs.generation

    @property
    def clock(self) -> Clock:
        return self._deps.clock

    async def request(self, intent: Intent) -> Outcome:
        if self._task is None or self._task.done():
            return NotFound(self.name, f"model {self.name!r} is not running on this agent")
        reply: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.post(Request(intent, reply))
        return await reply

    async def fresh_figures(self) -> Observation | None:
        """Request figures read by an engine call begun after this call (``look``); None unless
        the same process is active before and after (its view: ``self.view``, no await since)."""
        return await self._look(lambda: self.view.phase is Phase.ACTIVE)

    def post(self, message: Message) -> None:
        """Put ``message`` in the inbox (news from a helper, a timer, a test)."""
        self._inbox.put_nowait(message)

    async def detach(self) -> None:
        """Stop supervising without touching the engine: the agent is shutting down."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.cancel_helpers()
        self._look.cancel()
        self._turns.end()
        self._procs.close()
        await self._engine.close()

    # ---- the loop -------------------------------------------------------------------------

    async def _run(self, mode: StartMode, pid: int | None) -> None:
        try:
            await self._life.begin(mode, pid)
            if mode is not StartMode.SPAWN and not self.spawned.done():
                self.spawned.set_result(None)
            self.publish()  # readers see the start-up's outcome (adopted, say) at once
            if self.view.phase in (Phase.FAILED, Phase.RESTARTING):
                self._promises.settle()
            while self.view.phase is not Phase.STOPPED:
                message = await self._inbox.get()
                try:
                    await self._handle(message)
                except Exception as exc:  # noqa: BLE001 - one message must not end supervision
                    self._failed_handling(message, exc)
                self.publish()
                if self.view.phase not in (Phase.ACTIVATING, Phase.BOOTING):
                    self._promises.settle()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: record it where an operator looks, keep the agent alive
            log.exception("owner of %s crashed", self.name)
            self.record.last_error = "agent error while supervising this engine (see agent log)"
            self.publish()
            raise
        finally:  # nobody waits for an answer that can no longer come
            self._promises.answer(self.record.last_error
                                  or "its supervision ended before it started")

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

    async def _handle(self, message: Message) -> None:
        if isinstance(message, FromProcess) and not self._procs.current(message.gen):
            return  # from a process that is gone
        life = self._life
        match message:
            case Request(intent=Stop()):
                self._changed()
                if await self._ends.stop(message):
                    self._refuse_the_rest()
            case Request(intent=Revive()):
                self._changed()
                await self._ends.revive(message)
            case Request():
                self._changed()  # an intent (a KV limit, a sleep...): look closely again
                await self._intents.on_request(message)
            case StagingProgress():
                if self._staging.progress(message, life.waiting_to_start):
                    self.emit("Staging", f"waiting for {self.spec.artifact_url} in the weight "
                              "cache")
            case Staged():
                await life.staged(message)
            case TurnGranted(token=token, reason=reason):
                await life.turn_granted(token, reason)
            case Exited(info=info):
                await life.after_exit(info, None)
            case Unusable(why=why):  # stuck or unloadable: end this process; the exit decides
                self._procs.kill(why)
            case Ready(sleeping=sleeping):
                await life.on_ready(sleeping)
            case Health():
                await self._observer.on_health(message)
            case PersistDue():
                if self._writer.due():
                    await self.persist()
            case SpawnRetry(reason=reason):
                if life.waiting_to_start:
                    await life.spawn(reason)
            case KvReading(info=info, writes=writes):
                kv_before = self._kv.state
                if await self._kv.reading(info, writes):
                    await self.persist()
                if self._kv.state != kv_before:  # its use moved, a write, a loss
                    self._changed()
            case Figures(observation=observation):
                if observation != self._figures:  # requests came or went
                    self._changed()
                self._figures, self._figures_at = observation, self.clock.wall()
                await self._observer.on_sleep_level(observation.sleep_level)
            case OpDone():
                await self._intents.on_op_done(message)
                await self._drain()
            case AdapterDone():
                await self._lora.on_done(message)
                await self._drain()
            case AdaptersSynced():
                self._lora.on_synced(message)
            case RestartDue():
                await life.restart_due()

    async def _drain(self) -> None:
        """The requests deferred behind an operation, once none is in flight."""
        while (request := self._ops.next_deferred()) is not None:
            await self._intents.on_request(request)

    def _refuse_the_rest(self) -> None:
        """Intents that raced with a stop are answered: it was stopped."""
        while not self._inbox.empty():
            message = self._inbox.get_nowait()
            if isinstance(message, Request):
                resolve(message.reply, NotFound(self.name, f"model {self.name!r} was stopped"))

    # ---- state changes (the ``OwnerLoop`` protocol) ---------------------------------------

    async def transition(self, to: Phase, reason: str, message: str,
                         persist: bool = True, duration_s: float | None = None) -> None:
        src = self.view.phase
        if to is not src:
            check_transition(src, to)
            self.record.phase = to
            self.record.last_transition = self.clock.wall()
        if persist and to is not Phase.STOPPED:  # on disk before anyone is told: an agent
            await self.persist()  # killed right after leaves what its readers saw
        if to is not src:
            self.publish()
            self.emit(reason, message, src=src, to=to, duration_s=duration_s)

    async def persist(self) -> bool:
        """Write the record (fsync: off the event loop); False when the disk refused it, which
        is reported and retried (``records``), never fatal."""
        self._kv.persist_into(self.record)
        self._peak_into(self.record)
        return await self._writer.write(copy.deepcopy(self.record))

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
        for pace in self._paces:
            pace.nudge()

    def emit(self, reason: str, message: str, src: Phase | None = None,
             to: Phase | None = None, duration_s: float | None = None) -> None:
        self._changed()  # every event (a transition, a KV limit set, a miss) is a change
        self._deps.on_event(EngineEvent(
            at=self.clock.wall(), model_name=self.name, engine_id=self.record.engine_id,
            src=(src or self.view.phase).value, dst=(to or self.view.phase).value,
            reason=reason, message=message, duration_s=duration_s))

    def publish(self) -> None:
        view = self._make_view()
        if view != self.view:  # readers re-render only on a real change (snapshot ETags)
            self.view = view
            self._deps.on_view(view)

    def _forget_figures(self) -> None:
        """A new process, or none: its request figures are not known yet, nor when they were
        read (``request_figures_at`` is never an older process's reading)."""
        self._figures, self._figures_at = None, None

    def _make_view(self) -> EngineView:
        r, life = self.record, self._life
        return make_view(r, Seen(
            alive=self._procs.proc is not None,
            ready=life.ready and r.phase is Phase.ACTIVE and not self._liveness.unresponsive,
            adopted=life.adopted, operation=self._ops.action, figures=self._figures,
            figures_at=self._figures_at, kv=self._kv.state,
            loaded=frozenset(a.name for a in r.adapters if self._lora.serves(a.name)),
            staging=self._staging.view,
            storage_failing=r.engine_id in self._deps.storage.failing,
            port_held=life.port_held, queued=self._turns.queued,
            unresponsive=self._liveness.unresponsive, log_path=str(self.log_path),
            simulated=simulated(self._settings, r.spec)))

    def helper(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._helpers.add(task)
        task.add_done_callback(self._helpers.discard)

    def cancel_helpers(self) -> None:
        for task in list(self._helpers):
            task.cancel()
        self._helpers.clear()
