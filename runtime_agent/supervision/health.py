"""Alive is not enough, and the engine's word beats the record: what a health probe decides.

Functions over ``EngineOwner``, called only from inside the owner's task. A ready engine is
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

Misses in a row make the engine not ready, with the condition ``EngineUnresponsive``, after
``unresponsive_after``; once unresponsive for ``unresponsive_grace_s`` it is treated as
crashed: its whole process group is killed and it restarts with backoff. A stopped (SIGSTOP) or
deadlocked engine is caught this way; a booting one is the start-stall watch's business.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from contract.phases import Phase
from contract.reasons import ENGINE_UNRESPONSIVE
from runtime_agent.supervision.messages import Health

if TYPE_CHECKING:
    from runtime_agent.supervision.owner import EngineOwner


async def on_health(owner: EngineOwner, probe: Health) -> None:
    if not probe.answered:
        _missed(owner, probe.failures)  # a stopped engine mid-sleep is caught too
    elif owner._op is None:  # while a sleep or wake runs, its end decides the phase
        await _answered(owner, probe)
    elif owner._unresponsive_since is not None:
        owner._unresponsive_since = None
        owner._emit("Responsive", "the engine answers its health probe again")


async def _answered(owner: EngineOwner, probe: Health) -> None:
    s, now = owner._settings, owner._deps.clock()
    if owner._unresponsive_since is not None:
        owner._unresponsive_since = None
        owner._emit("Responsive", "the engine answers its health probe again")
    phase = owner.view.phase
    changed = False
    if probe.sleeping is not None and phase in (Phase.ACTIVE, Phase.SLEEPING):
        target = Phase.SLEEPING if probe.sleeping else Phase.ACTIVE
        owner._deps.memory.set_sleeping(owner.name, probe.sleeping)
        # The record first, then the move: the view a move publishes says all of it at once
        # (never `sleeping` with the desired state of before). A call cut short by an agent
        # restart may still run in the engine (a wake takes seconds): ``settle_operation``.
        changed = settle_operation(owner, probe.sleeping)
        if probe.sleeping and owner.record.sleep_level is None:
            owner.record.sleep_level = 2  # a level not known: wake the way that reloads weights
            changed = True
        if target is not phase:
            await owner._transition(target, "Observed", "the engine says it is "
                                    + ("asleep" if probe.sleeping else "awake"), persist=False)
            changed = True
        elif changed:
            owner._publish()
    healthy_since = owner.record.healthy_since
    if (owner.record.restart_count and healthy_since is not None
            and now - healthy_since >= s.budget_reset_s):
        owner._emit("RestartBudgetReset", f"served {now - healthy_since:.0f} s without a crash; "
                    f"{owner.record.restart_count} restart(s) forgiven")
        owner.record.restart_count = 0
        changed = True
    if changed:
        await owner._persist()


def settle_operation(owner: EngineOwner, sleeping: bool) -> bool:
    """A sleep or wake a previous agent left in flight ends once the engine is where the call
    was going, or once the call can no longer be running (its lifecycle timeout); desired is
    then what was reached. True when it ended (the record changed)."""
    op = owner.record.operation
    if op is None or not (sleeping is (op.action == "sleep") or owner._deps.clock()
                          - op.started_at > owner._settings.lifecycle_timeout_s):
        return False
    owner.record.operation = None
    owner.record.desired = "asleep" if sleeping else "awake"
    if sleeping and op.action == "sleep":
        owner.record.sleep_level = op.level  # the call's own level, not a guess
    return True


async def on_sleep_level(owner: EngineOwner, level: int | None) -> None:
    """The engine's own word on the level of its sleep (vLLM's ``vllm:engine_sleep_state``,
    read with its request figures) beats the record's: a record rebuilt from the process
    carries the level of its start only, and a level no record held was guessed as 2."""
    if (level not in (1, 2) or owner.view.phase is not Phase.SLEEPING or owner._op is not None
            or owner.record.operation is not None or owner.record.sleep_level == level):
        return
    owner.record.sleep_level = level
    await owner._persist()


def _missed(owner: EngineOwner, misses: int) -> None:
    s, now = owner._settings, owner._deps.clock()
    if misses < s.unresponsive_after:
        return
    if owner._unresponsive_since is None:
        owner._unresponsive_since = now
        owner._emit(ENGINE_UNRESPONSIVE, f"no answer to {misses} health probes in a row; "
                    f"restarted if it does not answer within {s.unresponsive_grace_s:g} s")
        return
    if now - owner._unresponsive_since >= s.unresponsive_grace_s and owner._proc is not None:
        owner._exit_cause = (f"unresponsive: no answer to its health probe for "
                             f"{now - owner._unresponsive_since:.0f} s")
        owner._proc.signal_group(signal.SIGKILL)  # SIGKILL ends a stopped process too
