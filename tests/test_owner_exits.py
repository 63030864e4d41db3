"""An engine owner's restart and stop paths, tested directly over the recording fakes.

News from a dead process is void during the backoff too; a restart says which one it is; a
re-activated failed engine starts again at once and each spent budget is counted; a stop that
fails midway never turns into a restart; a stop left half done by a dead agent is finished; a
new engine whose record cannot be written says so and frees its memory.
"""

from __future__ import annotations

import asyncio
import errno
import signal
from pathlib import Path

import pytest

from contract.phases import Phase
from engines.driver import Observation
from runtime_agent.kv.segment import create_segment
from runtime_agent.supervision.messages import (
    Exited,
    Figures,
    RestartDue,
    Revive,
    Sleep,
    StartMode,
    Stop,
)
from runtime_agent.supervision.outcomes import Done, EngineFailed
from runtime_agent.supervision.owner import EngineOwner
from tests.owner_fakes import OwnerRig, fast_settings, make_record

pytestmark = pytest.mark.loop_guard  # the in-process core must not block its loop


async def active(rig: OwnerRig, owner: EngineOwner | None = None) -> EngineOwner:
    owner = owner or rig.start()
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    return owner


# ---- restarts -------------------------------------------------------------------------------


async def test_late_news_from_a_crashed_process_is_dropped_during_the_backoff(
        tmp_path: Path) -> None:
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, restart_delays=(30,)))
    try:
        owner = await active(rig)
        dead = owner.generation  # what the process's helpers stamp their news with
        rig.launcher.last.exit(code=3)
        await rig.until(lambda: owner.view.phase is Phase.RESTARTING, "restarting")
        # its figure scrape, late: the figures of a dead process are not the engine's
        owner.post(Figures(dead, Observation(running=5, waiting=2, success_total=9)))
        await rig.ask(Sleep(1))  # answered after it was handled
        assert owner.view.requests_running is None
        # its exit, told twice: one crash is one restart, not a spent budget
        owner.post(Exited(dead, rig.launcher.last.exited.result()))
        await rig.ask(Sleep(1))
        assert owner.view.phase is Phase.RESTARTING and owner.view.restart_count == 1
        assert [e.reason for e in rig.events if e.dst in ("restarting", "failed")] == ["Exited"]
    finally:
        await rig.close()


async def test_a_restart_says_which_it_is_and_the_restarted_engine_can_be_stopped(
        rig: OwnerRig) -> None:
    owner = await active(rig)
    rig.launcher.last.exit(code=1)
    await rig.until(lambda: len(rig.launcher.spawned) == 2 and owner.view.phase is Phase.ACTIVE,
                    "restarted")
    [booted] = [e for e in rig.events if e.src == "restarting" and e.dst == "booting"]
    assert (booted.reason, booted.message) == ("restart 1", "pid 4002 on port 20000")
    stopped = await rig.ask(Stop())
    assert isinstance(stopped, Done) and stopped.phase is Phase.STOPPED
    assert rig.launcher.last.calls == ["stop:10"] and rig.store.records == {}


async def test_a_failed_engine_activated_again_restarts_at_once_and_each_spent_budget_counts(
        tmp_path: Path) -> None:
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, restart_delays=()))
    try:
        rig.record_timers()
        owner = await active(rig)
        for n in (1, 2):
            rig.launcher.last.exit(code=9)
            await rig.until(lambda: owner.view.phase is Phase.FAILED, "failed")
            assert owner.view.budget_exhausted == n  # AIBrix and the metrics read a count
            assert isinstance(await rig.ask(Revive()), Done)
            await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active again")
            # started again at once: the failure already waited out a whole budget
            assert [delay for delay, _ in rig.scheduled(RestartDue)] == [0] * n
        assert len(rig.launcher.spawned) == 3
    finally:
        await rig.close()


# ---- stops ----------------------------------------------------------------------------------


async def test_a_stop_that_fails_midway_never_becomes_a_restart_and_can_be_asked_again(
        rig: OwnerRig) -> None:
    owner = await active(rig)
    rig.launcher.leftovers_fail = OSError(errno.EMFILE, "Too many open files")
    failed = await rig.ask(Stop())
    assert isinstance(failed, EngineFailed) and "try again" in failed.message
    assert rig.launcher.last.calls == ["stop:10"]  # the process was stopped before the fault
    await rig.ask(Sleep(1))  # answered after its exit was handled
    # the stopped process's exit is not a crash: nothing counted, nothing scheduled
    assert owner.view.restart_count == 0 and owner.view.last_exit is None
    assert len(rig.launcher.spawned) == 1 and owner.view.phase is Phase.STOPPING
    rig.launcher.leftovers_fail = None
    stopped = await rig.ask(Stop())
    assert isinstance(stopped, Done) and stopped.phase is Phase.STOPPED
    assert rig.store.records == {}


async def test_a_stop_during_the_backoff_that_fails_midway_can_be_asked_again(
        tmp_path: Path) -> None:
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, restart_delays=(30,)))
    try:
        owner = await active(rig)
        rig.launcher.last.exit(code=1)
        await rig.until(lambda: owner.view.phase is Phase.RESTARTING, "restarting")
        rig.launcher.leftovers_fail = OSError(errno.EMFILE, "Too many open files")
        assert isinstance(await rig.ask(Stop()), EngineFailed)
        rig.launcher.leftovers_fail = None
        stopped = await rig.ask(Stop())
        assert isinstance(stopped, Done) and stopped.details["message"] == "no process was running"
        assert len(rig.launcher.spawned) == 1 and rig.store.records == {}
    finally:
        await rig.close()


async def test_a_segment_the_crashed_engine_made_before_it_was_read_is_removed(
        tmp_path: Path) -> None:
    """kvcached leaves its segment behind on SIGKILL; one made after the engine was spawned
    is the engine's, even if the agent never read it (it looks once a minute here)."""
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, restart_delays=(30,), kv_watch_s=60))
    try:
        owner = await active(rig)
        create_segment("kvc_m1", 1 << 30, rig.settings.kv_shm_dir)
        rig.launcher.last.exit(sig=signal.SIGKILL)
        await rig.until(lambda: owner.view.phase is Phase.RESTARTING
                        and rig.launcher.leftovers_killed != [], "the crash handled")
        assert not (rig.settings.kv_shm_dir / "kvc_m1").exists()
    finally:
        await rig.close()


async def test_each_engine_whose_record_cannot_be_removed_is_logged(
        rig: OwnerRig, caplog: pytest.LogCaptureFixture) -> None:
    """Owners share one throttled logger (one per agent): one engine's failure must not hide
    another's."""
    first = await active(rig)
    second = EngineOwner(make_record("m2", engine_id="f" * 16, port=20001), rig.deps)
    second.start(StartMode.SPAWN)
    try:
        await active(rig, second)
        rig.store.fail_delete = errno.EIO
        for owner in (first, second):
            assert isinstance(await owner.request(Stop()), Done)
    finally:
        await second.detach()
    assert sorted(r.getMessage().split(":")[0] for r in caplog.records
                  if r.getMessage().startswith("record of stopped")) == [
        "record of stopped m1 not removed", "record of stopped m2 not removed"]


@pytest.mark.parametrize("alive", [True, False])
async def test_a_stop_a_dead_agent_left_half_done_is_finished(rig: OwnerRig, alive: bool,
                                                            caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    running = await rig.launcher.spawn(["x"], {}, Path("/dev/null"))
    pid = running.pid if alive else 999
    record = make_record(pid=pid, pid_start_time=running.start_time, phase=Phase.STOPPING)
    owner = rig.start(record, StartMode.STOP, pid)
    await rig.until(lambda: owner.view.phase is Phase.STOPPED, "stopped")
    await rig.until(lambda: owner.started and owner.finished.done(), "owner ended")
    [stopped] = [e for e in rig.events if e.dst == "stopped"]
    if alive:
        assert running.calls == ["stop:10"] and stopped.message == "killed by signal SIGTERM"
    else:
        assert running.calls == [] and stopped.message == "no process was running"
    assert rig.store.records == {} and owner.view.last_error is None
    assert not [r for r in caplog.records if "crashed" in r.getMessage()]


# ---- a new engine whose record cannot be written --------------------------------------------


async def test_a_new_engine_whose_record_cannot_be_written_says_so_and_frees_its_memory(
        rig: OwnerRig) -> None:
    stopped = rig.told_memory("stopped")
    rig.store.fail = errno.EROFS
    owner = rig.start()
    said = "cannot start: its record cannot be written (EROFS (OSError, errno 30))"
    assert await asyncio.wait_for(owner.spawned, 5) == said
    assert [(e.src, e.reason, e.message) for e in rig.events if e.dst == "failed"] == [
        ("activating", "StorageUnavailable", said)]
    assert owner.view.last_error == said and stopped == ["m1"]

