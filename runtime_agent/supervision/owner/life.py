"""An engine's process from its start until it answers: spawn, adopt, ready, its watchers.

Called only from inside the owner's task (``loop``), through ``OwnerLoop`` and the parts it is
given. It keeps what belongs to the process's life: whether the engine answered (ready), was
re-adopted, must be steered to its desired sleep state (converge), and waits for its port (on
the injected clock). How a process ends (exit, stop, revive) is ``ends``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from msgspec import Struct

from contract.phases import Phase
from contract.reasons import PORT_HELD, START_FAILED, START_QUEUED, STORAGE_UNAVAILABLE
from engines.driver import EngineDriver
from engines.process import EngineProcess, ExitInfo, SpawnError, group_workers
from runtime_agent.cadence import Pacer
from runtime_agent.kv.keeper import KvKeeper
from runtime_agent.loops import keep_running
from runtime_agent.supervision import watchers
from runtime_agent.supervision.engine_kinds import engine_command, simulated
from runtime_agent.supervision.messages import (
    Exited,
    KvReading,
    Request,
    SpawnRetry,
    Staged,
    StartMode,
    Stop,
    TurnGranted,
    Unusable,
)
from runtime_agent.supervision.outcomes import Outcome
from runtime_agent.supervision.owner.deps import OwnerDeps
from runtime_agent.supervision.owner.intents import Intents
from runtime_agent.supervision.owner.liveness import Liveness
from runtime_agent.supervision.owner.lora import Lora
from runtime_agent.supervision.owner.observe import Observer
from runtime_agent.supervision.owner.ends import Ends
from runtime_agent.supervision.owner.port import OwnerLoop, post_later
from runtime_agent.supervision.owner.promises import Promises
from runtime_agent.supervision.owner.slots import ProcessSlot
from runtime_agent.supervision.owner.weights import STAGING_FAILED, FailWith, StagingSlot, StartOn
from runtime_agent.supervision.owner.turns import TurnSlot

log = logging.getLogger(__name__)

# How long an activation whose weights are being staged waits for the staging's end before it is
# answered `activating` (a start waiting for its card or its port is answered at once).
STAGING_ANSWER_S = 2.0


class Parts(Struct, frozen=True):
    """The owner's parts a process's life uses."""

    procs: ProcessSlot
    liveness: Liveness
    staging: StagingSlot
    turns: TurnSlot
    lora: Lora
    intents: Intents
    observer: Observer
    promises: Promises
    ends: Ends


class Life:
    def __init__(self, loop: OwnerLoop, deps: OwnerDeps, engine: EngineDriver, kv: KvKeeper,
                 log_path: Path, parts: Parts, paces: tuple[Pacer, Pacer, Pacer],
                 forget_figures: Callable[[], None]) -> None:
        self._loop, self._deps, self._settings = loop, deps, deps.settings
        self._engine, self._kv, self._log_path, self._p = engine, kv, log_path, parts
        self._health_pace, self._scrape_pace, self._kv_pace = paces
        self._forget_figures = forget_figures
        self.ready = False
        self.adopted = False
        self._converge = True  # after a spawn, steer the engine to the desired sleep state
        self._port_retry_s = 0.0

    @property
    def port_held(self) -> bool:
        return bool(self._port_retry_s)

    @property
    def waiting_to_start(self) -> bool:
        """No process, and a start is owed (not stopped, nor started another way)."""
        return self._p.procs.proc is None and self._loop.phase in (Phase.ACTIVATING,
                                                                   Phase.RESTARTING)

    async def after_exit(self, info: ExitInfo | None, why: str | None,
                         restart_now: bool = False) -> None:
        """The process is gone without being asked to stop (``ends``)."""
        was_ready, self.ready = self.ready, False
        await self._p.ends.after_exit(info, why, was_ready, restart_now)

    # ---- starting -------------------------------------------------------------------------

    async def begin(self, mode: StartMode, pid: int | None) -> None:
        record, loop = self._loop.record, self._loop
        match mode:
            case StartMode.ADOPT if pid is not None:
                await self._adopt(pid)
            case StartMode.RESTART if record.pid is None and record.phase in (
                    Phase.ACTIVATING, Phase.RESTARTING):
                # No process of it ever ran under the previous agent's eyes: that agent died
                # before the start, or while a restart it had already counted was due. The
                # start it owed is made now and counts nothing: an agent's restart never
                # spends an engine's restart budget.
                await self.spawn("activated" if record.phase is Phase.ACTIVATING
                                 else f"restart {record.restart_count}")
            case StartMode.RESTART:
                await self.after_exit(None, "its process was gone when the agent started",
                                      restart_now=True)
            case StartMode.STOP:  # the previous agent died while stopping this engine
                if pid is not None and (proc := self._deps.launcher.attach(pid)) is not None:
                    self._p.procs.keep(proc)
                reply: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
                loop.post(Request(Stop(), reply))
            case StartMode.SPAWN:
                if await loop.persist():  # the record is durable before any process starts
                    await self.spawn("activated")
                else:
                    record.last_error = ("cannot start: its record cannot be written "
                                         f"({self._deps.storage.problem})")
                    await loop.transition(Phase.FAILED, STORAGE_UNAVAILABLE, record.last_error,
                                          persist=False)
                    self._deps.memory.stopped(loop.name)
                    self._p.promises.started(record.last_error)

    async def spawn(self, reason: str) -> None:
        """Start the engine once it has its turn on its cards (``turns``); the turn is held
        until the engine answers (or its start ends otherwise)."""
        loop, record = self._loop, self._loop.record
        if (stage := self._p.staging.first(record, reason)) is not None:
            loop.helper(stage)  # weights first (the cache), then the turn
            # A staging that fails does so fast (403, no such object): its caller hears it in
            # the answer; one that takes longer is answered `activating` (Staging) meanwhile.
            loop.clock.later(STAGING_ANSWER_S, lambda: self._p.promises.answer(None))
            return
        token, turn = self._p.turns.request(record.devices, label=loop.name,
                                            shared=record.per_gpu is not None)
        if turn.granted.done():  # nothing conflicts on its cards: start now
            await self._spawn_now(reason)
            return
        loop.emit(START_QUEUED, self._p.turns.queued_because(record.devices, turn))
        self._p.promises.answer(None)  # the activation answers now: queued, and why (StartQueued)

        def granted(fut: asyncio.Future[None]) -> None:
            if not fut.cancelled():
                loop.post(TurnGranted(token, reason))

        turn.granted.add_done_callback(granted)

    async def turn_granted(self, token: int, reason: str) -> None:
        if not self._p.turns.current(token):
            pass  # a turn given back already; the current one is another's
        elif self.waiting_to_start:
            await self._spawn_now(reason)
        else:
            self._p.turns.end()

    async def staged(self, staged: Staged) -> None:
        loop = self._loop
        plan = self._p.staging.staged(staged, self.waiting_to_start, loop.record.spec.artifact_url)
        if isinstance(plan, StartOn):
            await self.spawn(plan.reason)
        elif isinstance(plan, FailWith):
            loop.record.last_error = plan.error
            self._deps.memory.stopped(loop.name)
            await loop.transition(Phase.FAILED, STAGING_FAILED, plan.error)
            self._p.promises.started(plan.error)

    async def restart_due(self) -> None:
        self._p.ends.restart_fired()
        if self._loop.phase is Phase.RESTARTING:
            await self.spawn(f"restart {self._loop.record.restart_count}")

    async def _spawn_now(self, reason: str) -> None:
        loop, record, s = self._loop, self._loop.record, self._settings
        spec = record.spec
        if not self._deps.port_free(record.port, s.engine_bind_host):
            # The engine keeps its port for life; another process holds it. Wait for it with
            # a growing pause, as the kubelet does: a restart would only burn the budget.
            self._p.turns.end()
            first = self._port_retry_s == 0
            self._port_retry_s = min(30.0, max(1.0, self._port_retry_s * 2))
            record.last_error = (f"port {record.port} is held by another process, so "
                                 "the engine cannot listen on it; waiting for it")
            if first:
                loop.emit(PORT_HELD, f"{record.last_error}; trying again in "
                          f"{self._port_retry_s:g} s and growing")
            self._p.promises.answer(None)  # waiting for its port: the view says so (PortHeld)
            post_later(loop, self._port_retry_s, SpawnRetry(self._p.procs.generation, reason))
            return
        self._port_retry_s = 0.0
        try:
            argv, env = engine_command(s, record, self._engine,
                                       model_path=self._p.staging.model_path)
            spawned_at = loop.clock.wall()
            proc = await self._deps.launcher.spawn(argv, env, self._log_path)
        except (SpawnError, ValueError, OSError) as exc:
            record.last_error = f"cannot start engine: {exc}"
            self._p.turns.end()
            self._deps.memory.stopped(loop.name)
            await loop.transition(Phase.FAILED, START_FAILED, record.last_error)
            self._p.promises.started(record.last_error)
            return
        self._kv.new_process(spawned_at)
        # Ollama loads its model after the server starts; not when it is meant to sleep.
        self._attach(proc, prepare=record.desired == "awake" or spec.engine != "ollama")
        record.pid, record.pid_start_time = proc.pid, proc.start_time
        self._converge = True
        await loop.transition(Phase.BOOTING, reason, f"pid {proc.pid} on port {record.port}")
        self._p.promises.started(None)
        log.info("engine %s started: pid %d port %d (%s)%s", spec.model_name, proc.pid,
                 record.port, reason, f"; SIMULATED {spec.engine} (python -m engines.sim)"
                 if simulated(s, spec) else "", extra={"model": spec.model_name})

    async def _adopt(self, pid: int) -> None:
        loop = self._loop
        proc = self._deps.launcher.attach(pid)
        if proc is None:
            self.adopted = False
            await self.after_exit(None, "its process ended while the agent re-adopted it",
                                  restart_now=True)
            return
        self._attach(proc)
        self.adopted = True
        self._converge = False  # the engine's own word on sleep is the truth after adoption
        loop.emit("readopted", f"pid {pid} on port {loop.record.port}", to=loop.phase)
        if loop.phase is Phase.ACTIVATING:
            await loop.transition(Phase.BOOTING, "readopted", f"pid {pid}")

    def _attach(self, proc: EngineProcess, prepare: bool = False) -> None:
        loop, s = self._loop, self._settings
        gen = self._p.procs.attach(proc)
        self.ready = False
        self._forget_figures()
        self._p.lora.new_process()
        self._p.liveness.reset()

        def exited(fut: asyncio.Future[ExitInfo]) -> None:
            if not fut.cancelled():
                loop.post(Exited(gen, fut.result()))

        proc.exited.add_done_callback(exited)
        asleep = loop.record.phase is Phase.SLEEPING  # a re-adopted engine that was asleep
        loop.helper(watchers.probe_ready(self._engine, s, loop.post, gen, prepare, loop.clock,
                                         asleep))
        loop.helper(watchers.watch_progress(self._log_path, s, loop.post, gen,
                                            lambda: self.ready, loop.clock))
        self._keep_running("KV-limit holding", lambda: self._kv.watch(
            lambda info, writes: loop.post(KvReading(gen, info, writes)),
            s.kv_watch_s, self._kv_pace, lambda: self.ready))

    def _keep_running(self, what: str, watch: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """A watcher for this process's life, restarted if it fails (``loops.keep_running``)."""
        self._loop.helper(keep_running(f"{what} of {self._loop.name}", watch,
                                       self._deps.throttled, clock=self._loop.clock))

    async def on_ready(self, sleeping: bool | None) -> None:
        loop, record, s, p = self._loop, self._loop.record, self._settings, self._p
        self.ready = True
        if record.last_error is not None:  # healthy again: an exit stays in last_exit
            record.last_error = None
            loop.publish()
        if sleeping is None:  # the engine does not say (SGLang): a new process is awake, a
            sleeping = self.adopted and record.phase is Phase.SLEEPING  # re-adopted as recorded
        target = Phase.SLEEPING if sleeping else Phase.ACTIVE
        # The engine's own word: a re-adopted engine may have finished a sleep its record
        # never saw (the agent died during the call), and the ledger must charge it so.
        self._deps.memory.set_sleeping(loop.name, target is Phase.SLEEPING)
        if self.adopted and not self._converge:  # before the move: its view says it all
            p.observer.settle_operation(sleeping)  # a call the old agent left in flight
        if self.adopted and not self._converge and record.operation is None:
            record.desired = "asleep" if sleeping else "awake"
            if sleeping and record.sleep_level is None:
                record.sleep_level = 2  # unknown: wake it the way that reloads weights
        # Its workers are watched before any reader is told it is ready: a worker that dies
        # after "active" was published is then always seen (one that died before the scan is
        # gone from the table, and would never be). Engines that become ready together share
        # one or two process scans (``group_workers``), so 32 re-adopted at once wait a scan,
        # not 32 of them queued on the thread pool (issue 26).
        await self._watch_workers()
        if target is loop.phase:  # a re-adopted engine: no move, but followers learn it
            loop.emit("Ready", "re-adopted engine answers /health", to=target)
            # and readers with them: the move's write below is not waited for (no phase is
            # told before the disk has it), so 32 such writes queued behind each other on the
            # thread pool no longer hold back 32 ready views (issue 26)
            loop.publish()
        if record.healthy_since is None:
            record.healthy_since = loop.clock.wall()
        await loop.transition(target, "Ready", "answers /health")
        p.turns.end()  # after its event: the next start on its cards is told after it
        loop.publish()
        gen, post, engine = loop.generation, loop.post, self._engine
        self._keep_running("request-figure scrape", lambda: watchers.scrape(
            engine, s, post, gen, self._scrape_pace))
        self._keep_running("health probe", lambda: watchers.watch_health(
            engine, s, post, gen, lambda: loop.phase is Phase.SLEEPING,
            lambda: p.intents.busy, self._health_pace))
        if self._converge and record.desired == "asleep" and target is Phase.ACTIVE:
            await p.intents.sleep_after_restart()  # its adapters come back when it is woken
        elif target is Phase.ACTIVE:
            p.lora.sync_after_ready()

    async def _watch_workers(self) -> None:
        """An engine is its whole process group: a worker that dies (vLLM's EngineCore) while
        the API server lives makes the engine unusable, so it is treated as a crash."""
        loop, procs = self._loop, self._p.procs
        proc, gen = procs.proc, procs.generation
        if proc is None or not hasattr(proc, "watch_workers"):
            return
        workers = await asyncio.to_thread(group_workers, proc.pid)  # blocking /proc reads

        def ended(pid: int, name: str) -> None:
            loop.post(Unusable(gen, f"its worker {name} (pid {pid}) exited while its API "
                               "server lived"))

        if procs.proc is proc:
            proc.watch_workers(workers, ended)
