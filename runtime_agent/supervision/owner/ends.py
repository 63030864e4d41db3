"""How an engine's process ends: an exit (restart or fail), a stop for good, a revive.

Called only from inside the owner's task, through ``OwnerLoop`` and the parts it is given. It
keeps the restart timer (on the injected clock): scheduled after an exit or a revive, cancelled
by a stop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

from msgspec import Struct

from contract.clock import Timer
from contract.phases import Phase
from contract.reasons import PORT_HELD, RESTART_BUDGET_EXHAUSTED
from engines.driver import EngineDriver
from engines.process import ExitInfo, tail_lines
from registry import stops
from runtime_agent.kv.keeper import KvKeeper
from runtime_agent.supervision.backoff import restart_delay
from runtime_agent.supervision.messages import Request, RestartDue
from runtime_agent.supervision.outcomes import NotFound
from runtime_agent.supervision.owner.answers import done, resolve
from runtime_agent.supervision.owner.deps import OwnerDeps
from runtime_agent.supervision.owner.intents import Intents
from runtime_agent.supervision.owner.liveness import Liveness
from runtime_agent.supervision.owner.lora import Lora
from runtime_agent.supervision.owner.port import OwnerLoop, post_later
from runtime_agent.supervision.owner.promises import Promises
from runtime_agent.supervision.owner.records import RecordWriter
from runtime_agent.supervision.owner.slots import ProcessSlot
from runtime_agent.supervision.owner.turns import TurnSlot
from runtime_agent.supervision.ports import lost_its_port


class EndParts(Struct, frozen=True):
    """The owner's parts an end touches."""

    procs: ProcessSlot
    liveness: Liveness
    writer: RecordWriter
    turns: TurnSlot
    lora: Lora
    intents: Intents
    promises: Promises


class Ends:
    def __init__(self, loop: OwnerLoop, deps: OwnerDeps, engine: EngineDriver, kv: KvKeeper,
                 log_path: Path, parts: EndParts, forget_figures: Callable[[], None]) -> None:
        self._loop, self._deps, self._settings = loop, deps, deps.settings
        self._engine, self._kv, self._log_path, self._p = engine, kv, log_path, parts
        self._forget_figures = forget_figures
        self._restart_timer: Timer | None = None

    def _restart_in(self, delay_s: float) -> None:
        self._restart_timer = post_later(self._loop, delay_s,
                                         RestartDue(self._p.procs.generation))

    def restart_fired(self) -> None:
        self._restart_timer = None

    async def _kill_leftovers(self) -> None:
        """Helpers that left the engine's group die now (by engine id)."""
        await asyncio.to_thread(self._deps.launcher.kill_leftovers,
                                str(self._settings.state_dir), self._loop.record.engine_id)

    # ---- exits ----------------------------------------------------------------------------

    async def after_exit(self, info: ExitInfo | None, why: str | None, was_ready: bool,
                         restart_now: bool = False) -> None:
        """The engine's process is gone without being asked to stop: restart it or fail it.

        The decision and its transition come first, written to the record at once (an agent
        killed next must find the exit, not the dead pid); the leftover segment, the log tail
        and the record again follow (the tail before the move, for a terminal failure). A
        restart that falls due meanwhile waits in the inbox until this returns."""
        loop, record, s, p = self._loop, self._loop.record, self._settings, self._p
        loop.cancel_helpers()
        p.turns.end()
        p.procs.lost()  # results already queued by the dead process's helpers are void
        p.intents.fail_all("the engine exited during the operation")
        self._forget_figures()
        p.lora.new_process()
        p.liveness.reset()
        record.healthy_since = None  # a crash: the budget's clock starts again
        cause = p.procs.cause(why or (info.describe() if info else "exited"))
        record.last_error = record.last_exit = cause
        record.pid = record.pid_start_time = None
        delay = restart_delay(record.restart_count, s.restart_delays)
        if not was_ready and info is not None and await self._port_was_taken():
            # Not a crash: a stranger bound the port after our check. Start again at once; the
            # start waits for the port (PortHeld) while it is held. No restart is spent.
            self._deps.memory.exited(loop.name)
            await loop.transition(Phase.RESTARTING, PORT_HELD, f"port {record.port} was "
                                  "taken by another process before the engine bound it")
            self._restart_in(0)
        elif delay is None:  # terminal: no hurry; the log tail belongs in last_error at once,
            await self._add_log_tail(cause)  # and `failed` is read as "nothing of it is left"
            await self._kv.remove_leftover()
            record.budget_exhausted += 1
            self._deps.memory.stopped(loop.name)
            msg = f"{cause}; restart budget of {len(s.restart_delays)} spent"
            await loop.transition(Phase.FAILED, RESTART_BUDGET_EXHAUSTED, msg, persist=False)
        else:
            self._deps.memory.exited(loop.name)
            if restart_now:
                delay = 0.0  # the agent was down for longer than any backoff already
            record.restart_count += 1  # counted when scheduled, as AIBrix reads it
            # written at once: an agent killed before the log tail is read must leave the
            # exit on disk, not the dead pid (the next agent would call it "gone at start")
            await loop.transition(Phase.RESTARTING, "Exited", f"{cause}; restart in {delay:g} s")
            self._restart_in(delay)
            await self._add_log_tail(cause)
        await self._kv.remove_leftover()
        # Its group died with its leader; helpers that left the group die now (by engine id).
        await self._kill_leftovers()
        await loop.persist()
        loop.publish()  # the log tail, now on disk

    async def _port_was_taken(self) -> bool:
        tail = await asyncio.to_thread(tail_lines, self._log_path, 20)  # blocking file read
        return lost_its_port(tail, self._loop.record.port)

    async def _add_log_tail(self, cause: str) -> None:
        """The exit's log tail joins ``last_exit`` in the record; the view shows it once the
        record is written (the exit handler's last step), never before: a reader must not see
        a tail that an agent killed now would not find on disk."""
        record = self._loop.record
        tail = await asyncio.to_thread(tail_lines, self._log_path, 20)  # blocking file read
        if tail:
            record.last_exit = cause + "\n" + "\n".join(tail)
            if record.last_error == cause:  # still the current error (not ready again)
                record.last_error = record.last_exit

    # ---- stopping -------------------------------------------------------------------------

    async def stop(self, request: Request) -> bool:
        """Stop the engine for good; False when the stop could not be made durable (refused)."""
        loop, record, s, p = self._loop, self._loop.record, self._settings, self._p
        if not await p.writer.stop_is_durable(s.kv_shm_dir, str(s.state_dir)):
            resolve(request.reply, self._deps.storage.refusal(loop.name)
                    or NotFound(loop.name, "unreachable"))
            return False
        if self._restart_timer is not None:
            self._restart_timer.cancel()
            self._restart_timer = None
        loop.cancel_helpers()
        p.intents.fail_all(f"model {loop.name!r} is being stopped")
        await loop.transition(Phase.STOPPING, "Deactivate", "stop requested", persist=False)
        proc = p.procs.release()
        if proc is not None:
            info = await proc.stop(s.stop_grace_s)
            detail = info.describe()
        else:
            detail = "no process was running"
        await self._kill_leftovers()
        record.pid = record.pid_start_time = None
        self._p.promises.started("deactivated before it started")
        p.turns.end()
        self._deps.memory.stopped(loop.name)
        await self._kv.remove_leftover(release_name=True)  # stopped for good: the name too
        await loop.transition(Phase.STOPPED, "Stopped", detail, persist=False)
        try:
            await asyncio.to_thread(self._deps.store.delete, record.engine_id)
        except OSError as exc:  # the record says STOPPING, or a marker remembers the stop
            self._deps.throttled.warning(f"delete:{loop.name}", "record of stopped %s not "
                                         "removed: %s", loop.name, exc)  # (registry.stops):
        else:  # the next agent ends it
            with contextlib.suppress(OSError):
                await asyncio.to_thread(stops.clear, s.kv_shm_dir, record.engine_id)
        self._deps.storage.failing.pop(record.engine_id, None)
        await self._engine.close()
        resolve(request.reply, done(loop.name, Phase.STOPPED, request.intent, details={
            "message": detail}))
        return True

    async def revive(self, request: Request) -> None:
        """Activated again with its spec: a failed engine starts over with a fresh restart
        budget (what it failed with stays in the event log); any other phase changes nothing."""
        loop, record = self._loop, self._loop.record
        if loop.phase is not Phase.FAILED:
            resolve(request.reply, done(loop.name, loop.phase, request.intent, changed=False))
            return
        if (unwritable := self._deps.storage.refusal(loop.name)) is not None:
            resolve(request.reply, unwritable)
            return
        failed_with = (record.last_error or "").splitlines()[:1]
        record.restart_count = 0
        await loop.transition(Phase.RESTARTING, "Reactivated", "activated again after it "
                              f"failed ({failed_with[0] if failed_with else 'no error'}); "
                              "starting with a fresh restart budget")
        self._restart_in(0)
        resolve(request.reply, done(loop.name, Phase.RESTARTING, request.intent, details={
            "message": "it had failed; started again with a fresh restart budget"}))
