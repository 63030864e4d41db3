"""The engine owner tested directly: a real owner over a recording launcher, driver and store.

No process and no socket: each test drives the owner's inbox through the fakes and asserts what
it did (signals, calls, records, events) and what it answered.
"""

from __future__ import annotations

import asyncio
import errno
import time
from msgspec.structs import replace
from pathlib import Path

import pytest

from contract.phases import Phase
from engines.process import ExitInfo, SpawnError
from registry.record import LoraAdapter
from runtime_agent.supervision.messages import (
    Health,
    Ready,
    SetKvLimit,
    Sleep,
    StartMode,
    Stop,
    Unusable,
    Wake,
)
from runtime_agent.supervision.outcomes import (
    Done,
    EngineFailed,
    NotFound,
    Refusal,
    Refused,
)
from runtime_agent.supervision.owner import EngineOwner
from runtime_agent.supervision.pool import EnginePool
from tests.owner_fakes import OwnerRig, fast_settings, make_record

pytestmark = pytest.mark.loop_guard  # the in-process core must not block its loop


async def active(rig: OwnerRig) -> None:
    """Started and active, with ``active`` written (the view is published before the write,
    so a test that breaks the disk next must wait for it)."""
    rig.start()
    await rig.until(lambda: rig.owner is not None and rig.owner.view.phase is Phase.ACTIVE
                    and any(r.phase is Phase.ACTIVE for r in rig.store.records.values()),
                    "active and written")


async def active_on_disk(rig: OwnerRig) -> None:
    """Active, and its record written so: no write is still under way (tests count writes)."""
    await active(rig)
    await rig.until(lambda: next(iter(rig.store.records.values())).phase is Phase.ACTIVE,
                    "the active phase on disk")


# ---- starting -------------------------------------------------------------------------------


async def test_the_record_is_durable_before_the_process_starts(rig: OwnerRig) -> None:
    saves_at_spawn: list[int] = []
    spawn = rig.launcher.spawn

    async def spying(*args, **kwargs):  # type: ignore[no-untyped-def]
        saves_at_spawn.append(rig.store.saves)
        return await spawn(*args, **kwargs)

    rig.launcher.spawn = spying  # type: ignore[method-assign]
    await active(rig)
    assert saves_at_spawn[0] >= 1
    await rig.until(lambda: next(iter(rig.store.records.values())).phase is Phase.ACTIVE,
                    "the active phase on disk")


async def test_a_ready_engine_is_active_and_ready(rig: OwnerRig) -> None:
    await active(rig)
    assert rig.owner is not None
    view = rig.owner.view
    assert view.ready and view.alive and view.pid == rig.launcher.last.pid
    assert [e.dst for e in rig.events][:2] == ["booting", "active"]


async def test_an_engine_that_cannot_be_spawned_fails_with_the_reason(rig: OwnerRig) -> None:
    rig.launcher.fail_with = SpawnError("no such executable: vllm")
    owner = rig.start()
    assert await asyncio.wait_for(owner.spawned, 5) == "cannot start engine: no such executable: vllm"
    assert owner.view.phase is Phase.FAILED and "StartFailed" in rig.reasons()


# ---- crashes and restarts -----------------------------------------------------------------


async def test_a_crash_restarts_after_the_backoff_and_counts(rig: OwnerRig) -> None:
    await active(rig)
    first = rig.launcher.last
    first.exit(code=3)
    await rig.until(lambda: len(rig.launcher.spawned) == 2 and rig.owner is not None
                    and rig.owner.view.phase is Phase.ACTIVE, "restarted")
    assert rig.owner is not None
    assert rig.owner.view.restart_count == 1
    assert "exited with code 3" in (rig.owner.view.last_exit or "")
    assert rig.owner.view.last_error is None  # ready again: no current error
    assert ["booting", "active", "restarting", "booting", "active"] == [
        e.dst for e in rig.events if e.src != e.dst]


async def test_the_restart_budget_ends_in_failed_with_the_last_error(rig: OwnerRig) -> None:
    await active(rig)
    for n in range(4):  # three restarts, then the budget of three is spent
        await rig.until(lambda: len(rig.launcher.spawned) == n + 1, f"process {n + 1}")
        rig.launcher.last.exit(code=7)
    assert rig.owner is not None
    await rig.until(lambda: rig.owner is not None and rig.owner.view.phase is Phase.FAILED,
                    "failed")
    assert len(rig.launcher.spawned) == 4
    assert rig.owner.view.last_error is not None and "code 7" in rig.owner.view.last_error
    assert "RestartBudgetExhausted" in rig.reasons()


async def test_an_unusable_engine_has_its_group_killed_and_is_restarted(rig: OwnerRig) -> None:
    await active(rig)
    assert rig.owner is not None
    proc = rig.launcher.last
    rig.owner.post(Unusable(rig.owner.generation, "stuck"))
    await rig.until(lambda: len(rig.launcher.spawned) == 2, "restart")
    assert proc.calls == ["signal_group:SIGKILL"]
    assert (rig.owner.view.last_exit or "").startswith("stuck (then killed by signal SIGKILL)")


@pytest.fixture
async def slow(tmp_path: Path):
    """A rig whose one restart waits 30 s, so the restarting state can be looked at."""
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, restart_delays=(30,)))
    yield rig
    await rig.close()


async def test_a_crash_is_told_with_its_log_tail_and_written_once(slow: OwnerRig) -> None:
    await active_on_disk(slow)
    assert slow.owner is not None
    slow.owner.log_path.write_text("".join(f"line {i}\n" for i in range(25)))
    # whatever the old process was (unresponsive here), the new one starts clean
    slow.owner.post(Health(slow.owner.generation, False, None, slow.settings.unresponsive_after))
    await slow.until(lambda: "EngineUnresponsive" in slow.owner.view.conditions, "unresponsive")
    exited = slow.told_memory("exited")
    saved = slow.store.saves
    slow.launcher.last.exit(code=3)
    await slow.until(lambda: next(iter(slow.store.records.values())).phase is Phase.RESTARTING,
                     "restarting on disk")
    await asyncio.sleep(0.05)
    # the transition is written before it is told (an agent killed next keeps the exit), and
    # the record again with the log tail
    assert slow.store.saves == saved + 2
    view = slow.owner.view
    tail = "\n".join(f"line {i}" for i in range(5, 25))
    assert view.last_error == "exited with code 3\n" + tail
    assert view.pid is None and not view.alive and view.conditions == ()
    [event] = [e for e in slow.events if e.dst == "restarting"]
    assert (event.src, event.reason, event.message) == ("active", "Exited",
                                                        "exited with code 3; restart in 30 s")
    assert exited == ["m1"]
    slow.owner.post(Ready(slow.owner.generation - 1, False))  # the dead one, late
    await asyncio.sleep(0.05)
    assert slow.owner.view.phase is Phase.RESTARTING


async def test_an_engine_gone_when_the_agent_starts_is_restarted_at_once(slow: OwnerRig) -> None:
    owner = slow.start(make_record(phase=Phase.ACTIVE), StartMode.RESTART)
    await slow.until(lambda: len(slow.launcher.spawned) == 1
                     and owner.view.phase is Phase.ACTIVE, "restarted")
    [event] = [e for e in slow.events if e.dst == "restarting"]
    assert event.message == "its process was gone when the agent started; restart in 0 s"


async def test_a_spent_budget_fails_the_engine_once_with_its_tail(tmp_path: Path) -> None:
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, restart_delays=()))
    try:
        await active_on_disk(rig)
        assert rig.owner is not None
        rig.owner.log_path.write_text("Traceback\nCUDA error\n")
        stopped = rig.told_memory("stopped")
        saved = rig.store.saves
        rig.launcher.last.exit(code=7)
        await rig.until(lambda: next(iter(rig.store.records.values())).phase is Phase.FAILED,
                        "failed on disk")
        await asyncio.sleep(0.05)
        assert rig.store.saves == saved + 1
        assert rig.owner.view.last_error == "exited with code 7\nTraceback\nCUDA error"
        assert rig.owner.record.budget_exhausted == 1 and stopped == ["m1"]
        [event] = [e for e in rig.events if e.dst == "failed"]
        assert (event.reason, event.message) == ("RestartBudgetExhausted",
                                                 "exited with code 7; restart budget of 0 spent")
    finally:
        await rig.close()


async def test_a_crash_kills_the_engines_helpers_that_left_its_group(slow: OwnerRig) -> None:
    """The owner has its launcher kill what the engine left (its cgroup, then every process
    with its id: tests/test_process.py and tests/faults/test_cgroups.py kill real ones)."""
    await active(slow)
    assert slow.launcher.leftovers_killed == []
    slow.launcher.last.exit(code=1)
    await slow.until(lambda: slow.launcher.leftovers_killed == ["e" * 16], "leftovers killed")
    assert slow.launcher.leftovers_in == [str(slow.settings.state_dir)]  # where engines are found


async def test_a_sleep_cut_short_by_a_crash_is_told_why(slow: OwnerRig) -> None:
    slow.driver.hold = asyncio.Event()
    await active(slow)
    sleeping = asyncio.ensure_future(slow.ask(Sleep(1)))
    await slow.until(lambda: "sleep:1" in slow.driver.calls, "sleep sent")
    slow.launcher.last.exit(code=1)
    slept = await sleeping
    assert isinstance(slept, Refused)
    assert slept.message == "the engine exited during the operation; try again"


async def test_a_crashed_engine_with_adapters_is_restarted(tmp_path: Path) -> None:
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, restart_delays=(30,)))
    try:
        rig.start(make_record(adapters=[LoraAdapter(name="sql", path="/a/sql")]))
        await rig.until(lambda: rig.owner is not None and rig.owner.view.phase is Phase.ACTIVE,
                        "active")
        assert rig.owner is not None
        rig.launcher.last.exit(code=1)
        await rig.until(lambda: rig.owner is not None
                        and rig.owner.view.phase is Phase.RESTARTING, "restarting")
        assert rig.owner.view.adapters == (("sql", "/a/sql", False),)
    finally:
        await rig.close()


async def test_news_from_a_dead_process_is_dropped(rig: OwnerRig) -> None:
    await active(rig)
    assert rig.owner is not None
    old_gen = rig.owner.generation
    rig.driver.healthy_answer = False  # the new process never answers
    rig.launcher.last.exit(code=1)
    await rig.until(lambda: len(rig.launcher.spawned) == 2, "restart")
    rig.owner.post(Ready(old_gen, False))  # a late answer about the old one
    await asyncio.sleep(0.05)
    assert rig.owner.view.phase is Phase.BOOTING and not rig.owner.view.ready


# ---- stopping -------------------------------------------------------------------------------


async def test_a_stop_terminates_with_grace_and_forgets_the_engine(rig: OwnerRig) -> None:
    await active(rig)
    proc = rig.launcher.last
    outcome = await rig.ask(Stop())
    assert isinstance(outcome, Done) and outcome.phase is Phase.STOPPED
    assert proc.calls == ["stop:10"]  # SIGTERM, the grace, then SIGKILL: EngineProcess.stop
    assert rig.store.records == {}
    assert rig.owner is not None and rig.owner.view.phase is Phase.STOPPED


async def test_a_stopped_engine_leaving_the_pool_is_a_change_readers_see(
        rig: OwnerRig) -> None:
    """The agent renders its snapshot once per view change: the engine's removal from the pool
    after its STOPPED view must be one more change, or a snapshot rendered in between (the
    engine listed as stopped) is served until something else changes."""
    listed: list[bool] = []  # at each view change: is the engine still in the pool?
    deps = replace(rig.deps, on_view=lambda view: listed.append(view.spec.model_name
                                                                 in pool.owners))
    pool = EnginePool(deps)
    owner = pool.owners["m1"] = EngineOwner(make_record("m1"), deps)
    owner.start(StartMode.SPAWN, None)
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    outcome = await pool.deactivate("m1")
    await owner.detach()
    assert isinstance(outcome, Done) and outcome.phase is Phase.STOPPED
    assert pool.owners == {}
    assert listed and listed[-1] is False, "the last change seen still listed the engine"


async def test_a_stop_answers_a_sleep_in_flight_and_later_callers(rig: OwnerRig) -> None:
    rig.driver.hold = asyncio.Event()
    await active(rig)
    assert rig.owner is not None
    sleeping = asyncio.ensure_future(rig.ask(Sleep(1)))
    await rig.until(lambda: "sleep:1" in rig.driver.calls, "sleep sent")
    stopped = await rig.ask(Stop())
    slept = await sleeping
    assert isinstance(stopped, Done)
    assert isinstance(slept, Refused) and slept.kind is Refusal.CONFLICT
    assert isinstance(await rig.owner.request(Wake()), NotFound)


async def test_a_stop_during_the_backoff_cancels_the_restart(rig: OwnerRig) -> None:
    rig.settings = fast_settings(rig.settings.state_dir.parent, restart_delays=(30,))
    rig.deps = replace(rig.deps, settings=rig.settings)
    await active(rig)
    rig.launcher.last.exit(code=1)
    await rig.until(lambda: rig.owner is not None and rig.owner.view.phase is Phase.RESTARTING,
                    "restarting")
    outcome = await rig.ask(Stop())
    assert isinstance(outcome, Done) and outcome.details["message"] == "no process was running"
    await asyncio.sleep(0.05)
    assert len(rig.launcher.spawned) == 1


async def test_a_stop_says_what_it_did_and_writes_only_the_stopping_record(rig: OwnerRig) -> None:
    await active_on_disk(rig)
    assert rig.owner is not None
    saved = rig.store.saves
    outcome = await rig.ask(Stop())
    assert isinstance(outcome, Done) and outcome.details["message"] == "killed by signal SIGTERM"
    assert [(e.src, e.dst, e.reason, e.message) for e in rig.events if e.src != e.dst][-2:] == [
        ("active", "stopping", "Deactivate", "stop requested"),
        ("stopping", "stopped", "Stopped", "killed by signal SIGTERM")]
    assert rig.store.saves == saved + 1  # the STOPPING record before the stop, nothing after
    view = rig.owner.view
    assert view.pid is None and not view.alive and not view.ready


async def test_a_stop_frees_the_engines_memory_and_forgets_its_storage_trouble(
        rig: OwnerRig) -> None:
    await active(rig)
    stopped = rig.told_memory("stopped")
    rig.store.fail = errno.ENOSPC  # the STOPPING write fails; the unlink works
    unlinked_before_the_stop: list[bool] = []
    proc = rig.launcher.last
    stop = proc.stop

    async def stop_spying(grace_s: float) -> ExitInfo:
        unlinked_before_the_stop.append(rig.store.records == {})
        return await stop(grace_s)

    proc.stop = stop_spying  # type: ignore[method-assign]
    outcome = await rig.ask(Stop())
    assert isinstance(outcome, Done) and outcome.phase is Phase.STOPPED
    assert unlinked_before_the_stop == [True]  # the disk forgot it before the process went
    assert stopped == ["m1"]
    assert "e" * 16 not in rig.deps.storage.failing  # /healthz is not degraded by a gone engine


async def test_a_stopped_engine_whose_record_cannot_be_removed_stays_stopping_on_disk(
        rig: OwnerRig, caplog: pytest.LogCaptureFixture) -> None:
    await active(rig)
    rig.store.fail_delete = errno.EIO
    outcome = await rig.ask(Stop())
    assert isinstance(outcome, Done) and outcome.phase is Phase.STOPPED
    [left] = rig.store.records.values()
    assert left.phase is Phase.STOPPING  # the next agent finishes the stop, it does not restart
    assert any(r.getMessage().startswith("record of stopped m1 not removed: [Errno 5]")
               for r in caplog.records)


async def test_a_stop_before_the_engine_started_says_so_to_whoever_waits_for_the_start(
        rig: OwnerRig) -> None:
    rig.port_free = False  # the engine waits for its port: no process yet
    owner = rig.start()
    await rig.until(lambda: "PortHeld" in rig.reasons(), "port held")
    outcome = await rig.ask(Stop())
    assert isinstance(outcome, Done) and outcome.details["message"] == "no process was running"
    assert await asyncio.wait_for(owner.spawned, 5) == "deactivated before it started"
    assert rig.launcher.spawned == []


async def test_intents_that_race_with_a_stop_are_answered_not_found(rig: OwnerRig) -> None:
    await active(rig)
    assert rig.owner is not None
    rig.launcher.last._stop_takes_s = 0.5  # type: ignore[attr-defined]
    stopping = asyncio.ensure_future(rig.ask(Stop()))
    await rig.until(lambda: rig.launcher.last.calls == ["stop:10"], "stop under way")
    late = await rig.ask(Wake())
    assert isinstance(await stopping, Done)
    assert isinstance(late, NotFound) and late.message == "model 'm1' was stopped"
    assert late.model_name == "m1"


def no_stop_marker(rig: OwnerRig) -> Path:
    """Where a stop the registry cannot record is remembered, made unwritable (a directory)."""
    marker = rig.settings.kv_shm_dir / f"{'e' * 16}.stopped"
    marker.mkdir(parents=True)
    return marker


async def test_a_stop_refused_for_the_disk_names_the_engine(rig: OwnerRig) -> None:
    await active(rig)
    rig.store.fail = rig.store.fail_delete = errno.EROFS
    no_stop_marker(rig)
    refused = await rig.ask(Stop())
    assert isinstance(refused, Refused) and refused.model_name == "m1"


async def test_a_stop_kills_the_engines_helpers_that_left_its_group(rig: OwnerRig) -> None:
    """A helper that left the engine's group (a setsid worker) dies with the stop: the owner
    has its launcher kill the engine's leftovers before it answers."""
    await active(rig)
    outcome = await rig.ask(Stop())
    assert isinstance(outcome, Done)
    assert rig.launcher.leftovers_killed == ["e" * 16]
    assert rig.launcher.leftovers_in == [str(rig.settings.state_dir)]  # where engines are found


async def test_a_sleep_cut_short_by_a_stop_is_told_why(rig: OwnerRig) -> None:
    rig.driver.hold = asyncio.Event()
    await active(rig)
    sleeping = asyncio.ensure_future(rig.ask(Sleep(1)))
    await rig.until(lambda: "sleep:1" in rig.driver.calls, "sleep sent")
    await rig.ask(Stop())
    slept = await sleeping
    assert isinstance(slept, Refused) and slept.message == "model 'm1' is being stopped; try again"


# ---- sleep and wake -----------------------------------------------------------------------


async def test_sleep_then_sleep_again_changes_nothing_the_second_time(rig: OwnerRig) -> None:
    await active(rig)
    first = await rig.ask(Sleep(1, "op-1"))
    again = await rig.ask(Sleep(1))
    replay = await rig.ask(Sleep(1, "op-1"))
    assert isinstance(first, Done) and first.changed and first.phase is Phase.SLEEPING
    assert isinstance(again, Done) and not again.changed
    assert isinstance(replay, Done) and not replay.changed
    assert rig.driver.calls.count("sleep:1") == 1


async def test_a_wake_from_level_two_says_so_to_the_engine(rig: OwnerRig) -> None:
    await active(rig)
    await rig.ask(Sleep(2))
    woke = await rig.ask(Wake("w"))
    assert isinstance(woke, Done) and woke.phase is Phase.ACTIVE
    assert [c for c in rig.driver.calls if c.startswith(("sleep", "wake"))] == ["sleep:2",
                                                                                 "wake:2"]


async def test_a_failed_wake_leaves_the_engine_asleep_and_says_why(rig: OwnerRig) -> None:
    await active(rig)
    await rig.ask(Sleep(1))
    rig.driver.wake_error = "POST /wake_up answered 500"
    outcome = await rig.ask(Wake())
    assert isinstance(outcome, EngineFailed) and outcome.phase is Phase.SLEEPING
    assert "500" in outcome.message and "WakeFailed" in rig.reasons()


async def test_a_second_sleep_waits_for_the_first_and_changes_nothing(rig: OwnerRig) -> None:
    rig.driver.call_takes_s = 0.05
    await active(rig)
    first, second = await asyncio.gather(rig.ask(Sleep(1)), rig.ask(Sleep(1)))
    assert isinstance(first, Done) and first.changed
    assert isinstance(second, Done) and not second.changed


async def test_a_restarted_engine_that_was_asleep_goes_back_to_sleep(rig: OwnerRig) -> None:
    await active(rig)
    await rig.ask(Sleep(2))
    rig.driver.sleeping = False  # a new process starts awake
    rig.launcher.last.exit(code=1)
    await rig.until(lambda: len(rig.launcher.spawned) == 2 and rig.owner is not None
                    and rig.owner.view.phase is Phase.SLEEPING, "asleep again")
    assert rig.driver.calls.count("sleep:2") == 2


async def test_an_engine_that_is_not_up_cannot_sleep(rig: OwnerRig) -> None:
    rig.driver.healthy_answer = False
    rig.start()
    outcome = await rig.ask(Sleep(1))
    assert isinstance(outcome, Refused) and outcome.kind is Refusal.CONFLICT
    assert "booting" in outcome.message


# ---- re-adoption ----------------------------------------------------------------------------


async def test_an_adopted_engine_is_taken_at_its_own_word_on_sleep(rig: OwnerRig) -> None:
    running = await rig.launcher.spawn(["x"], {}, Path("/dev/null"))
    rig.driver.sleeping = True
    record = make_record(pid=running.pid, pid_start_time=running.start_time,
                         phase=Phase.ACTIVE, desired="awake")
    owner = rig.start(record, StartMode.ADOPT, running.pid)
    assert owner.view.adopted
    await rig.until(lambda: owner.view.phase is Phase.SLEEPING, "sleeping")
    assert owner.record.desired == "asleep" and len(rig.launcher.spawned) == 1


async def test_an_engine_gone_before_adoption_is_restarted_at_once(rig: OwnerRig) -> None:
    record = make_record(pid=999, pid_start_time=5, phase=Phase.ACTIVE)
    owner = rig.start(record, StartMode.ADOPT, 999)
    await rig.until(lambda: len(rig.launcher.spawned) == 1
                    and owner.view.phase is Phase.ACTIVE, "restarted")
    assert owner.view.restart_count == 1 and not owner.view.adopted


# ---- KV limits --------------------------------------------------------------------------------


async def test_a_kv_limit_before_the_segment_exists_is_recorded_not_in_force(
        rig: OwnerRig) -> None:
    await active(rig)
    outcome = await rig.ask(SetKvLimit(1 << 30, "kv-1"))
    assert isinstance(outcome, Done) and outcome.changed
    assert outcome.details["in_force"] is False
    assert next(iter(rig.store.records.values())).kv_limit_bytes == 1 << 30


# ---- faults: hung engines, what the engine says, storage, ports, budgets ---------------------

from registry.record import InFlight  # noqa: E402


@pytest.fixture
async def probed(tmp_path: Path):
    settings = fast_settings(tmp_path, restart_delays=(0.01, 0.02, 0.03), health_interval_s=0.01,
                             probe_timeout_s=0.01, unresponsive_after=3,
                             unresponsive_grace_s=0.1, budget_reset_s=3600)
    rig = OwnerRig(tmp_path, settings)
    yield rig
    await rig.close()


async def test_an_engine_that_stops_answering_is_not_ready_then_killed_and_restarted(
        probed: OwnerRig) -> None:
    await active(probed)
    assert probed.owner is not None
    stuck = probed.launcher.last
    probed.driver.probe_hangs = True  # SIGSTOP, a deadlock: no answer
    await probed.until(lambda: "EngineUnresponsive" in probed.reasons(), "unresponsive")
    assert not probed.owner.view.ready and "EngineUnresponsive" in probed.owner.view.conditions
    await probed.until(lambda: "signal_group:SIGKILL" in stuck.calls, "killed after the grace")
    probed.driver.probe_hangs = False  # the next process answers
    await probed.until(lambda: len(probed.launcher.spawned) == 2, "restarted")
    assert "unresponsive" in (probed.owner.view.last_error or "")


async def test_the_phase_follows_what_the_engine_says_about_sleep(probed: OwnerRig) -> None:
    await active(probed)
    assert probed.owner is not None
    probed.driver.sleeping = True  # asleep by someone else's hand, or by a lost call
    await probed.until(lambda: probed.owner is not None
                       and probed.owner.view.phase is Phase.SLEEPING, "observed asleep")
    assert "Observed" in probed.reasons()


async def test_a_sleep_cut_short_by_an_agent_restart_is_resolved_by_asking_the_engine(
        probed: OwnerRig) -> None:
    running = await probed.launcher.spawn(["x"], {}, Path("/dev/null"))
    probed.driver.sleeping = True  # the sleep went through after the old agent died
    record = make_record(pid=running.pid, pid_start_time=running.start_time, phase=Phase.ACTIVE,
                         desired="awake", operation=InFlight(action="sleep", level=1))
    owner = probed.start(record, StartMode.ADOPT, running.pid)
    # the record is written before the view is published: wait for the view
    await probed.until(lambda: owner.record.operation is None
                       and owner.view.phase is Phase.SLEEPING, "resolved")
    assert owner.record.desired == "asleep" == owner.view.desired


async def test_a_sleep_that_ends_after_the_restart_is_published_whole(probed: OwnerRig) -> None:
    running = await probed.launcher.spawn(["x"], {}, Path("/dev/null"))
    probed.driver.sleeping = False  # still going to sleep when the new agent looks
    record = make_record(pid=running.pid, pid_start_time=running.start_time, phase=Phase.ACTIVE,
                         desired="awake", operation=InFlight(action="sleep", level=1,
                                                           started_at=time.time()))
    owner = probed.start(record, StartMode.ADOPT, running.pid)
    await probed.until(lambda: owner.view.phase is Phase.ACTIVE and owner.view.ready, "ready")
    probed.driver.sleeping = True  # the sleep the old agent asked for ends now
    await probed.until(lambda: owner.view.phase is Phase.SLEEPING, "observed asleep")
    assert owner.view.desired == "asleep"
    # no reader ever saw the engine asleep with the desired state of before
    assert not [v for v in probed.views if v.phase is Phase.SLEEPING and v.desired != "asleep"]


async def test_a_wake_still_running_after_the_restart_is_settled_when_the_engine_wakes(
        probed: OwnerRig) -> None:
    running = await probed.launcher.spawn(["x"], {}, Path("/dev/null"))
    probed.driver.sleeping = True  # the old agent's wake is still under way in the engine
    record = make_record(pid=running.pid, pid_start_time=running.start_time,
                         phase=Phase.SLEEPING, desired="asleep", sleep_level=1,
                         operation=InFlight(action="wake", level=1, started_at=time.time()))
    owner = probed.start(record, StartMode.ADOPT, running.pid)
    await probed.until(lambda: owner.view.phase is Phase.SLEEPING and probed.driver.probes > 0,
                       "adopted asleep")
    probes = probed.driver.probes
    await probed.until(lambda: probed.driver.probes > probes + 5, "probed a while asleep")
    assert owner.record.operation is not None and owner.view.desired == "asleep"
    probed.driver.sleeping = False  # the wake ends
    await probed.until(lambda: owner.view.phase is Phase.ACTIVE, "observed awake")
    assert owner.view.desired == "awake" and owner.record.operation is None


async def test_a_cut_short_call_that_can_no_longer_be_running_settles_on_what_is(
        probed: OwnerRig) -> None:
    running = await probed.launcher.spawn(["x"], {}, Path("/dev/null"))
    probed.driver.sleeping = True  # the wake failed in the engine: it stays asleep
    long_ago = time.time() - probed.settings.lifecycle_timeout_s - 1
    record = make_record(pid=running.pid, pid_start_time=running.start_time,
                         phase=Phase.SLEEPING, desired="awake", sleep_level=1,
                         operation=InFlight(action="wake", level=1, started_at=long_ago))
    owner = probed.start(record, StartMode.ADOPT, running.pid)
    await probed.until(lambda: owner.record.operation is None
                       and owner.view.desired == owner.record.desired, "settled")
    assert owner.view.phase is Phase.SLEEPING and owner.view.desired == "asleep"


async def test_a_sleep_is_durable_before_the_engine_is_called(rig: OwnerRig) -> None:
    rig.driver.hold = asyncio.Event()
    await active(rig)
    asking = asyncio.ensure_future(rig.ask(Sleep(1)))
    await rig.until(lambda: "sleep:1" in rig.driver.calls, "sleep sent")
    on_disk = next(iter(rig.store.records.values()))
    assert on_disk.operation == InFlight(action="sleep", level=1,
                                         started_at=on_disk.operation.started_at)  # type: ignore[union-attr]
    rig.driver.hold.set()
    await asking
    await rig.until(lambda: next(iter(rig.store.records.values())).operation is None, "cleared")


async def test_a_full_disk_costs_no_control_and_refuses_what_it_cannot_remember(
        rig: OwnerRig) -> None:
    await active_on_disk(rig)  # else that write is the one that fails
    assert rig.owner is not None
    rig.store.fail = errno.ENOSPC
    first = await rig.ask(Sleep(1))  # nothing written yet: the sleep's own write finds out
    assert isinstance(first, Refused) and first.kind is Refusal.UNAVAILABLE
    assert not any(c.startswith("sleep") for c in rig.driver.calls)  # nothing was sent
    assert rig.owner.view.phase is Phase.ACTIVE and rig.owner.record.operation is None
    await rig.until(lambda: "StorageUnavailable" in rig.reasons(), "reported")
    refused = await rig.ask(Sleep(1))
    assert isinstance(refused, Refused) and refused.kind is Refusal.UNAVAILABLE
    assert "cannot be written" in refused.message
    rig.launcher.last.exit(code=1)  # the owner still supervises: it restarts the engine
    await rig.until(lambda: len(rig.launcher.spawned) == 2 and rig.owner is not None
                    and rig.owner.view.phase is Phase.ACTIVE, "restarted, awake as it was")
    rig.store.fail = None
    await rig.until(lambda: "StorageRecovered" in rig.reasons(), "recovered", timeout_s=20)
    await rig.until(lambda: rig.owner is not None
                    and "StorageUnavailable" not in rig.owner.view.conditions, "cleared")


async def test_a_new_engine_whose_record_cannot_be_written_never_starts(rig: OwnerRig) -> None:
    rig.store.fail = errno.EROFS
    owner = rig.start()
    assert "cannot be written" in str(await asyncio.wait_for(owner.spawned, 5))
    assert rig.launcher.spawned == [] and owner.view.phase is Phase.FAILED


async def test_a_stop_the_disk_cannot_remember_is_refused_and_touches_nothing(
        rig: OwnerRig) -> None:
    await active(rig)
    rig.store.fail = rig.store.fail_delete = errno.EROFS
    no_stop_marker(rig)  # nor remembered beside the KV segments (registry.stops)
    refused = await rig.ask(Stop())
    assert isinstance(refused, Refused) and refused.kind is Refusal.UNAVAILABLE
    assert rig.launcher.last.calls == [] and rig.owner is not None
    assert rig.owner.view.phase is Phase.ACTIVE
    rig.store.fail_delete = None  # a full disk: the record can still be removed
    stopped = await rig.ask(Stop())
    assert isinstance(stopped, Done) and stopped.phase is Phase.STOPPED
    assert rig.store.records == {}


async def test_a_port_held_by_a_stranger_is_waited_for_without_spending_the_budget(
        rig: OwnerRig) -> None:
    rig.port_free = False
    owner = rig.start()
    await rig.until(lambda: "PortHeld" in rig.reasons(), "port held")
    assert owner.view.phase is Phase.ACTIVATING and "PortHeld" in owner.view.conditions
    rig.port_free = True
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "started once free", timeout_s=15)
    assert owner.view.restart_count == 0 and "PortHeld" not in owner.view.conditions


async def test_the_restart_budget_starts_again_after_a_healthy_while(tmp_path: Path) -> None:
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, restart_delays=(0.01,),
                                           health_interval_s=0.01, budget_reset_s=0.05))
    try:
        await active(rig)
        rig.launcher.last.exit(code=1)
        # the event is told before the view is published (after the record is written)
        await rig.until(lambda: "RestartBudgetReset" in rig.reasons() and rig.owner is not None
                        and rig.owner.view.restart_count == 0, "forgiven")
        rig.launcher.last.exit(code=1)  # one more crash is restarted, not fatal
        await rig.until(lambda: len(rig.launcher.spawned) == 3, "restarted again")
    finally:
        await rig.close()


async def test_activating_a_failed_engine_again_starts_it_over(rig: OwnerRig) -> None:
    rig.settings = fast_settings(rig.settings.state_dir.parent, restart_delays=())
    rig.deps = replace(rig.deps, settings=rig.settings)
    await active(rig)
    rig.launcher.last.exit(code=9)
    await rig.until(lambda: rig.owner is not None and rig.owner.view.phase is Phase.FAILED,
                    "failed")
    from runtime_agent.supervision.messages import Revive

    revived = await rig.ask(Revive())
    assert isinstance(revived, Done) and revived.phase is Phase.RESTARTING and revived.changed
    assert revived.details["message"] == "it had failed; started again with a fresh restart budget"
    [event] = [e for e in rig.events if e.reason == "Reactivated"]
    assert (event.src, event.dst, event.message) == (
        "failed", "restarting", "activated again after it failed (exited with code 9); starting "
        "with a fresh restart budget")
    await rig.until(lambda: rig.owner is not None and rig.owner.view.phase is Phase.ACTIVE,
                    "active again")
    assert len(rig.launcher.spawned) == 2 and rig.owner.view.restart_count == 0


async def test_activating_an_engine_that_has_not_failed_changes_nothing(rig: OwnerRig) -> None:
    from runtime_agent.supervision.messages import Revive

    await active(rig)
    again = await rig.ask(Revive("op-9"))
    assert again == Done("m1", Phase.ACTIVE, changed=False, operation_id="op-9")
    assert len(rig.launcher.spawned) == 1 and "Reactivated" not in rig.reasons()


async def test_a_failed_engine_is_not_started_again_while_the_disk_refuses(rig: OwnerRig) -> None:
    from runtime_agent.supervision.messages import Revive

    rig.settings = fast_settings(rig.settings.state_dir.parent, restart_delays=())
    rig.deps = replace(rig.deps, settings=rig.settings)
    await active(rig)
    rig.store.fail = errno.ENOSPC
    rig.launcher.last.exit(code=9)
    await rig.until(lambda: rig.owner is not None and rig.owner.view.phase is Phase.FAILED
                    and "StorageUnavailable" in rig.reasons(), "failed, disk full")
    refused = await rig.ask(Revive())
    assert isinstance(refused, Refused) and refused.kind is Refusal.UNAVAILABLE
    assert refused.model_name == "m1" and len(rig.launcher.spawned) == 1


def test_a_process_that_outlives_sigkill_is_reported_not_waited_for() -> None:
    assert "uninterruptible" in ExitInfo(None, None, 0.0, lingering=True).describe()


async def test_activating_again_an_engine_that_failed_without_a_word_says_so(
        rig: OwnerRig) -> None:
    from runtime_agent.supervision.messages import Revive

    owner = rig.start(make_record(phase=Phase.FAILED, last_error=None), StartMode.IDLE)
    await rig.until(lambda: owner.view.phase is Phase.FAILED and owner.started, "idle")
    assert isinstance(await rig.ask(Revive()), Done)
    [event] = [e for e in rig.events if e.reason == "Reactivated"]
    assert event.message == ("activated again after it failed (no error); starting with a fresh "
                             "restart budget")
