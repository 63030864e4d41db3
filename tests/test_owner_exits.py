"""An engine owner's restart and stop paths, tested directly over the recording fakes.

News from a dead process is void during the backoff too; a restart says which one it is; a
re-activated failed engine starts again at once and each spent budget is counted; a stop that
fails midway never turns into a restart; a stop left half done by a dead agent is finished; a
new engine whose record cannot be written says so and frees its memory. An engine whose port a
stranger took before it bound it starts again at once, spending nothing; a stop the registry
cannot record is remembered beside the KV segments, and a stop gives the segment's name back.
"""

from __future__ import annotations

import asyncio
import errno
import signal
from pathlib import Path

import pytest

from contract.phases import Phase
from engines.driver import Observation
from registry import stops
from runtime_agent.kv.ownership import claim, marker_path
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
from runtime_agent.supervision.outcomes import Done, EngineFailed, NotFound, Refused
from runtime_agent.supervision.owner import EngineOwner
from tests.owner_fakes import OwnerRig, fast_settings, make_record
from tests.test_owner import no_stop_marker

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


async def test_the_answer_to_activating_a_failed_engine_again_names_it_and_says_what_it_did(
        tmp_path: Path) -> None:
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, restart_delays=()))
    try:
        owner = await active(rig)
        rig.launcher.last.exit(code=9)
        await rig.until(lambda: owner.view.phase is Phase.FAILED, "failed")
        assert await rig.ask(Revive()) == Done("m1", Phase.RESTARTING, details={
            "message": "it had failed; started again with a fresh restart budget"})
    finally:
        await rig.close()


@pytest.mark.parametrize(("phase", "reason"), [(Phase.ACTIVATING, "activated"),
                                                (Phase.RESTARTING, "restart 2")])
async def test_a_start_a_dead_agent_owed_is_made_by_the_next_one_and_spends_nothing(
        rig: OwnerRig, phase: Phase, reason: str) -> None:
    """The previous agent died before its start ran (no pid recorded): the start is made now,
    saying which it is, and no restart is spent on the agent's own restart."""
    owner = rig.start(make_record(phase=phase, restart_count=2 if reason != "activated" else 0),
                      StartMode.RESTART)
    await active(rig, owner)
    [booted] = [e for e in rig.events if e.dst == "booting"]
    assert (booted.src, booted.reason) == (phase.value, reason)
    assert owner.view.restart_count == (2 if reason != "activated" else 0)


@pytest.mark.parametrize(("port", "taken"), [(20000, True), (29500, False)])
async def test_an_engine_whose_port_was_taken_before_it_bound_starts_again_at_once_for_free(
        tmp_path: Path, port: int, taken: bool) -> None:
    """Its log says its own port was in use (a stranger bound it after the agent's check): not
    a crash, so no restart is spent and the start comes at once. A bind failure on another port
    (a distributed rendezvous) is the engine's own fault and spends one as any crash."""
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, restart_delays=(30,)))
    rig.driver.healthy_answer = False  # still loading when it dies: never ready
    try:
        rig.record_timers()
        exited = rig.told_memory("exited")
        owner = rig.start()
        await rig.until(lambda: owner.view.phase is Phase.BOOTING, "booting")
        rig.launcher.log_paths[0].write_text(
            "INFO: Started server process [7]\nERROR:    [Errno 98] error while attempting to "
            f"bind on address ('127.0.0.1', {port}): address already in use\n")
        rig.launcher.last.exit(code=1)
        await rig.until(lambda: owner.view.phase is not Phase.BOOTING
                        or len(rig.launcher.spawned) == 2, "the exit handled")
        [restarting] = [(e.src, e.reason, e.message) for e in rig.events
                        if e.dst == "restarting"]
        if taken:
            assert restarting == ("booting", "PortHeld", "port 20000 was taken by another "
                                  "process before the engine bound it")
            assert [delay for delay, _ in rig.scheduled(RestartDue)] == [0]
            await rig.until(lambda: len(rig.launcher.spawned) == 2, "started again at once")
            assert owner.view.restart_count == 0
        else:
            assert restarting[:2] == ("booting", "Exited")
            assert [delay for delay, _ in rig.scheduled(RestartDue)] == [30]
            assert owner.view.restart_count == 1
        assert exited == ["m1"]  # its memory is held for the start that follows
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


async def test_a_stop_the_registry_cannot_record_is_remembered_beside_the_kv_segments(
        rig: OwnerRig) -> None:
    """A read-only state directory: the record can be neither written nor removed, so the stop
    is remembered in the KV directory, where a restarted agent finds it and finishes the stop
    instead of starting the engine again from the stale record."""
    await active(rig)
    rig.store.fail = rig.store.fail_delete = errno.EROFS
    stopped = await rig.ask(Stop())
    assert isinstance(stopped, Done) and (stopped.model_name, stopped.phase) == (
        "m1", Phase.STOPPED)
    shm, state = rig.settings.kv_shm_dir, str(rig.settings.state_dir)
    assert stops.marked(shm, state, "e" * 16)  # by this agent's state directory
    where = stops.marker_path(shm, "e" * 16)
    assert ("StorageUnavailable", f"its record cannot be changed; the stop is remembered in "
            f"{where}, so a restarted agent finishes it instead of starting the engine again"
            ) in [(e.reason, e.message) for e in rig.events]


async def test_a_refused_stop_leaves_the_requests_behind_it_to_be_served(
        rig: OwnerRig) -> None:
    """Nothing could remember the stop, so nothing was stopped: an intent queued behind it is
    handled as usual, not told that the engine was stopped."""
    owner = await active(rig)
    rig.store.fail = rig.store.fail_delete = errno.EROFS
    no_stop_marker(rig)
    refused, behind = await asyncio.gather(rig.ask(Stop()), rig.ask(Revive()))
    assert isinstance(refused, Refused) and not isinstance(behind, NotFound)
    assert isinstance(behind, Done) and behind.model_name == "m1" and not behind.changed
    assert owner.view.phase is Phase.ACTIVE


async def test_a_finished_stop_gives_the_kv_name_back_and_forgets_a_remembered_stop(
        rig: OwnerRig) -> None:
    """Stopped for good: the claim on its KV segment name goes (another engine may take the
    name), and a stop a dead agent remembered beside the segments is forgotten once the
    record is removed (it would stop a later engine of that id)."""
    shm, state = rig.settings.kv_shm_dir, str(rig.settings.state_dir)
    inode = claim("kvc_m1", shm, state, "e" * 16, ours=lambda engine_id: False)
    stops.mark(shm, state, "e" * 16)
    owner = rig.start(make_record(phase=Phase.STOPPING, kv_owner_inode=inode), StartMode.STOP)
    await rig.until(lambda: owner.started and owner.finished.done(), "owner ended")
    assert owner.view.phase is Phase.STOPPED and rig.store.records == {}
    assert not Path(marker_path("kvc_m1", shm)).exists()
    assert not stops.marked(shm, state, "e" * 16)
    assert not stops.marker_path(shm, "e" * 16).exists()


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

