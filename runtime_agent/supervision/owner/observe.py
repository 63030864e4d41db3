"""Alive is not enough, and the engine's word beats the record: what a health probe decides.

Called only from inside the owner's task, through ``OwnerLoop``. A ready engine is
probed every ``health_interval_s`` after any change or miss, less often while its answers stay
the same (``watchers.watch_health``, ``runtime_agent.cadence``). Each answer:

- re-derives ACTIVE or SLEEPING from the engine itself, so the snapshot never contradicts the
  engine for longer than one (backed-off) probe interval, also after a sleep or wake that a
  previous agent started and never saw end (``record.operation``: resolved here, by
  observation, once the engine is where the call was going or the call can no longer be
  running);
- takes the level of a sleep from the engine when it says it (``on_sleep_level``);
- starts the restart budget again once the engine has served ``budget_reset_s`` without a crash
  (the kubelet's habit).

Misses in a row are judged by ``liveness`` (a pure verdict); the loop carries out a kill.
"""

from __future__ import annotations

from contract.phases import Phase
from contract.reasons import ENGINE_UNRESPONSIVE
from runtime_agent.gpu.broker import MemoryBroker
from runtime_agent.settings import Settings
from runtime_agent.supervision.messages import Health
from runtime_agent.supervision.owner.liveness import Liveness
from runtime_agent.supervision.owner.port import OwnerLoop
from runtime_agent.supervision.owner.slots import OperationSlot, ProcessSlot


class Observer:
    def __init__(self, loop: OwnerLoop, ops: OperationSlot, procs: ProcessSlot,
                 liveness: Liveness, memory: MemoryBroker, settings: Settings) -> None:
        self._loop, self._ops, self._procs, self._liveness = loop, ops, procs, liveness
        self._memory, self._settings = memory, settings

    async def on_health(self, probe: Health) -> None:
        if not probe.answered:
            self._missed(probe.failures)  # a stopped engine mid-sleep is caught too
        elif not self._ops.busy:  # while a sleep or wake runs, its end decides the phase
            await self._answered(probe)
        elif self._liveness.answered():
            self._loop.emit("Responsive", "the engine answers its health probe again")

    async def _answered(self, probe: Health) -> None:
        loop, s, now = self._loop, self._settings, self._loop.clock.wall()
        record = loop.record
        if self._liveness.answered():
            loop.emit("Responsive", "the engine answers its health probe again")
        phase = loop.phase
        changed = False
        if probe.sleeping is not None and phase in (Phase.ACTIVE, Phase.SLEEPING):
            target = Phase.SLEEPING if probe.sleeping else Phase.ACTIVE
            self._memory.set_sleeping(loop.name, probe.sleeping)
            # The record first, then the move: the view a move publishes says all of it at
            # once (never `sleeping` with the desired state of before). A call cut short by an
            # agent restart may still run in the engine (a wake takes seconds):
            # ``settle_operation``.
            changed = self.settle_operation(probe.sleeping)
            if probe.sleeping and record.sleep_level is None:
                record.sleep_level = 2  # a level not known: wake the way that reloads weights
                changed = True
            if target is not phase:
                await loop.transition(target, "Observed", "the engine says it is "
                                      + ("asleep" if probe.sleeping else "awake"), persist=False)
                changed = True
            elif changed:
                loop.publish()
        healthy_since = record.healthy_since
        if (record.restart_count and healthy_since is not None
                and now - healthy_since >= s.budget_reset_s):
            loop.emit("RestartBudgetReset", f"served {now - healthy_since:.0f} s without a "
                      f"crash; {record.restart_count} restart(s) forgiven")
            record.restart_count = 0
            changed = True
        if changed:
            await loop.persist()

    def settle_operation(self, sleeping: bool) -> bool:
        """A sleep or wake a previous agent left in flight ends once the engine is where the
        call was going, or once the call can no longer be running (its lifecycle timeout);
        desired is then what was reached. True when it ended (the record changed)."""
        record = self._loop.record
        op = record.operation
        if op is None or not (sleeping is (op.action == "sleep") or self._loop.clock.wall()
                              - op.started_at > self._settings.lifecycle_timeout_s):
            return False
        record.operation = None
        record.desired = "asleep" if sleeping else "awake"
        if sleeping and op.action == "sleep":
            record.sleep_level = op.level  # the call's own level, not a guess
        return True

    async def on_sleep_level(self, level: int | None) -> None:
        """The engine's own word on the level of its sleep (vLLM's ``vllm:engine_sleep_state``,
        read with its request figures) beats the record's: a record rebuilt from the process
        carries the level of its start only, and a level no record held was guessed as 2."""
        loop = self._loop
        record = loop.record
        if (level not in (1, 2) or loop.phase is not Phase.SLEEPING or self._ops.busy
                or record.operation is not None or record.sleep_level == level):
            return
        record.sleep_level = level
        await loop.persist()

    def _missed(self, misses: int) -> None:
        verdict = self._liveness.missed(misses, self._loop.clock.wall())
        if verdict.event is not None:
            self._loop.emit(ENGINE_UNRESPONSIVE, verdict.event)
        elif verdict.kill is not None and self._procs.proc is not None:
            self._procs.kill(verdict.kill)
