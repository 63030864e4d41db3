"""Engine process plumbing: log tails and bounded log files."""

from __future__ import annotations

from pathlib import Path

from engines.process import tail_lines, trim_log


def test_a_log_past_its_bound_keeps_its_older_half_aside_and_starts_again(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    size = log.stat().st_size
    assert trim_log(log, size + 1) is False
    assert trim_log(log, size // 2) is True
    assert log.stat().st_size == 0
    assert (tmp_path / "engine.log.1").read_text().endswith("line 999\n")
    with log.open("a") as fh:  # the engine appends (O_APPEND) and lands at the new end
        fh.write("after\n")
    assert log.read_text() == "after\n"


def test_the_tail_skips_blank_lines_and_survives_a_missing_file(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("a\n\nb\n  \nc\n")
    assert tail_lines(log, 2) == ["b", "c"]
    assert tail_lines(tmp_path / "nope.log") == []


# ---- real processes: what a stop and a crash do to an engine's whole tree ----------------------

import asyncio  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402

from engines.process import ProcessLauncher, group_workers  # noqa: E402
from registry.identity import process_start_time  # noqa: E402

# A leader that traps SIGTERM (writing a marker), with one child in its group and one descendant
# that left it (its own session), printing their pids.
_TREE = r"""
import os, signal, subprocess, sys, time
marker = sys.argv[1]
def on_term(*_):
    open(marker, "w").write("term")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
# The one that left is a grandchild (started by the child), so only a recursive walk finds it.
same = subprocess.Popen([sys.executable, "-c", (
    "import subprocess, sys, time; "
    "away = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
    "start_new_session=True); print(away.pid, flush=True); time.sleep(600)")],
    stdout=subprocess.PIPE)
away = int(same.stdout.readline())
print("PIDS", same.pid, away, flush=True)
time.sleep(600)
"""


def _said(log: Path, tag: str) -> list[str]:
    """The words after ``tag`` on the engine's output line that starts with it (the launcher's
    header line echoes the command, so output is tagged)."""
    for line in log.read_text().splitlines():
        if line.startswith(tag + " "):
            return line.split()[1:]
    return []


async def _tree(tmp_path: Path) -> tuple[object, int, int, Path]:
    marker = tmp_path / "got-sigterm"
    log = tmp_path / "engine.log"
    proc = await ProcessLauncher(tmp_path).spawn([sys.executable, "-c", _TREE, str(marker)],
                                                 dict(os.environ), log)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not _said(log, "PIDS"):
        assert loop.time() < deadline, "the tree never started"
        await asyncio.sleep(0.02)
    same, away = (int(p) for p in _said(log, "PIDS"))
    return proc, same, away, marker


async def _gone(pid: int, timeout_s: float = 10) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_stop_sends_sigterm_first_and_kills_what_left_the_group(tmp_path: Path) -> None:
    proc, same, away, marker = await _tree(tmp_path)
    info = await proc.stop(grace_s=10)  # type: ignore[attr-defined]
    assert marker.read_text() == "term"  # asked politely first, not killed at once
    assert info.code == 0
    assert await _gone(same) and await _gone(away)


async def test_a_stop_kills_a_leader_that_ignores_sigterm_after_the_grace(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('UP', 1, flush=True); time.sleep(600)"
    proc = await ProcessLauncher(tmp_path).spawn([sys.executable, "-c", code], dict(os.environ),
                                                 log)
    while not _said(log, "UP"):
        await asyncio.sleep(0.02)
    loop = asyncio.get_running_loop()
    began = loop.time()
    info = await proc.stop(grace_s=0.5)
    assert info.signal == signal.SIGKILL and loop.time() - began >= 0.5


async def test_when_the_leader_dies_its_group_dies_with_it(tmp_path: Path) -> None:
    proc, same, away, _ = await _tree(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    info = await asyncio.wait_for(proc.exited, 10)  # type: ignore[attr-defined]
    assert info.signal == signal.SIGKILL
    assert await _gone(same)  # an EngineCore left behind would hold the GPU
    os.kill(away, signal.SIGKILL)  # left its group: the owner's crash path handles it


async def test_a_stop_touches_nothing_outside_the_engines_tree(tmp_path: Path) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        proc, same, away, _ = await _tree(tmp_path)
        await proc.stop(grace_s=10)  # type: ignore[attr-defined]
        assert await _gone(same) and await _gone(away)
        assert bystander.poll() is None  # another child of the agent: not the engine's
    finally:
        bystander.kill()
        bystander.wait()


async def test_a_stop_that_cannot_end_the_process_reports_it_lingering_in_bounded_time(
        tmp_path: Path) -> None:
    """A process stuck in the kernel outlives SIGKILL; simulated by a leader that ignores
    SIGTERM and a SIGKILL that is never delivered (the fault is in the signal call)."""
    log = tmp_path / "engine.log"
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('UP', 1, flush=True); time.sleep(600)"
    proc = await ProcessLauncher(tmp_path).spawn([sys.executable, "-c", code], dict(os.environ),
                                                 log)
    try:
        while not _said(log, "UP"):
            await asyncio.sleep(0.02)
        sent: list[int] = []
        proc.signal_group = sent.append  # type: ignore[method-assign]
        before = time.monotonic()
        info = await asyncio.wait_for(proc.stop(grace_s=0.1, kill_wait_s=0.2), 30)
        assert sent == [signal.SIGTERM, signal.SIGKILL]
        assert info.lingering and info.code is None and info.signal is None
        assert isinstance(info.detected_at, float) and info.detected_at >= before
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.wait_for(proc.exited, 10)


async def test_an_exit_says_how_and_when_and_closing_afterwards_touches_nothing(
        tmp_path: Path) -> None:
    proc = await ProcessLauncher(tmp_path).spawn([sys.executable, "-c", "raise SystemExit(3)"],
                                                 dict(os.environ), tmp_path / "engine.log")
    before = time.monotonic()
    info = await asyncio.wait_for(proc.exited, 10)
    assert (info.code, info.signal, info.lingering) == (3, None, False)
    assert isinstance(info.detected_at, float) and info.detected_at >= before - 5
    proc.close()  # the agent shuts down after the exit: nothing left to close
    proc.close()
    os.fstat(1)  # ... and no descriptor of the agent's was closed in its place


async def test_subprocess_never_reaps_an_engine_so_its_exit_status_is_read(
        tmp_path: Path) -> None:
    """Engines are started through ``subprocess.Popen``; a Popen collected while its child
    runs is swept by the next Popen with ``waitpid``, which would take the status the pidfd
    watch reads. The launcher keeps its children out of that sweep."""
    import gc

    proc = await ProcessLauncher(tmp_path).spawn(
        [sys.executable, "-c", "import sys; sys.stdin.read(); raise SystemExit(5)"],
        dict(os.environ), tmp_path / "engine.log")
    try:
        # its stdin is /dev/null, so it ends at once; a sweep after that would reap it
        await asyncio.to_thread(os.waitid, os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        gc.collect()
        subprocess.run([sys.executable, "-c", "pass"], check=True)  # runs subprocess's sweep
        info = await asyncio.wait_for(proc.exited, 10)
    finally:
        proc.signal_group(signal.SIGKILL)
    assert (info.code, info.signal) == (5, None)


async def test_a_start_in_a_missing_directory_is_refused_before_any_process_runs(
        tmp_path: Path) -> None:
    from engines.process import SpawnError

    log = tmp_path / "engine.log"
    with pytest.raises(SpawnError, match="nope"):
        await ProcessLauncher(tmp_path / "nope").spawn([sys.executable, "-c", "pass"],
                                                       dict(os.environ), log)


async def test_the_launcher_records_the_start_time_the_kernel_reports(tmp_path: Path) -> None:
    proc = await ProcessLauncher(tmp_path).spawn(
        [sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ),
        tmp_path / "engine.log")
    try:
        assert proc.start_time == process_start_time(proc.pid) and proc.start_time > 0
    finally:
        await proc.stop(grace_s=10)


async def test_an_adopted_process_is_watched_and_its_status_is_unknown(tmp_path: Path) -> None:
    """Re-adoption: the engine is not the agent's child, so its exit status cannot be read."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             start_new_session=True)
    try:
        proc = ProcessLauncher(tmp_path).attach(other.pid)
        assert proc is not None and not proc.is_child and proc.pid == other.pid
        assert proc.start_time == process_start_time(other.pid)
        other.kill()
        info = await asyncio.wait_for(proc.exited, 10)
        assert (info.code, info.signal) == (None, None) and "status unknown" in info.describe()
        proc.close()
    finally:
        other.kill()
        other.wait()
    assert ProcessLauncher(tmp_path).attach(other.pid) is None  # gone: nothing to adopt


async def test_closing_a_watch_leaves_the_process_alone(tmp_path: Path) -> None:
    proc, same, away, _ = await _tree(tmp_path)
    proc.close()  # type: ignore[attr-defined]
    assert proc.exited.cancelled()  # type: ignore[attr-defined]
    proc.close()  # type: ignore[attr-defined]
    os.fstat(1)
    assert psutil.pid_exists(proc.pid)  # type: ignore[attr-defined]
    os.killpg(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    os.kill(away, signal.SIGKILL)
    # Nothing watches it any more, so the test reaps its own child (no zombie outlives it).
    await asyncio.to_thread(os.waitpid, proc.pid, 0)  # type: ignore[attr-defined]
    assert await _gone(same)


async def test_a_worker_that_dies_under_a_live_leader_is_reported(tmp_path: Path) -> None:
    proc, same, away, _ = await _tree(tmp_path)
    try:
        workers = await asyncio.to_thread(group_workers, proc.pid)  # type: ignore[attr-defined]
        assert [pid for pid, _ in workers] == [same]  # the one that left the group is no worker
        ended: list[tuple[int, str]] = []
        gone = subprocess.Popen(["true"])
        gone.wait()  # a worker that ended before the watch began is reported at once
        proc.watch_workers([(gone.pid, "early"), *workers],  # type: ignore[attr-defined]
                           lambda pid, name: ended.append((pid, name)))
        assert ended == [(gone.pid, "early")]
        os.kill(same, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while len(ended) < 2:
            assert loop.time() < deadline, "the worker's exit was not reported"
            await asyncio.sleep(0.02)
        assert ended[1] == workers[0]
    finally:
        await proc.stop(grace_s=10)  # type: ignore[attr-defined]
        os.kill(away, signal.SIGKILL)


async def test_workers_that_die_with_their_leader_are_not_reported(tmp_path: Path) -> None:
    proc, same, away, _ = await _tree(tmp_path)
    workers = await asyncio.to_thread(group_workers, proc.pid)  # type: ignore[attr-defined]
    ended: list[tuple[int, str]] = []
    proc.watch_workers(workers, lambda pid, name: ended.append((pid, name)))  # type: ignore[attr-defined]
    os.kill(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    await asyncio.wait_for(proc.exited, 10)  # type: ignore[attr-defined]
    assert await _gone(same)
    await asyncio.sleep(0.05)  # a late worker report would have been posted by now
    assert ended == []
    os.kill(away, signal.SIGKILL)


def test_the_tail_reads_at_most_its_byte_bound_from_the_end(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("first\n" + "".join(f"{i:04d}" + "x" * 1019 + "\n" for i in range(40)))
    tail = tail_lines(log, 30, max_bytes=4096)  # 4 whole lines of 1 KiB and a cut one
    assert len(tail) == 4 and tail[-1].startswith("0039") and tail[0].startswith("0036")
    assert tail_lines(log, 100, max_bytes=1 << 20)[0] == "first"  # from the very first byte
    log.write_bytes(b"ok\n\xff\xfe broken\n")
    assert tail_lines(log) == ["ok", "\ufffd\ufffd broken"]  # bad bytes never fail the tail


# ---- faults a stop must survive -------------------------------------------------------------

import pytest  # noqa: E402

from engines.process import _kill_survivors  # noqa: E402

_IGNORES_TERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                 "print('UP', 1, flush=True); time.sleep(600)")


async def _ignoring_term(tmp_path: Path) -> object:
    log = tmp_path / "engine.log"
    proc = await ProcessLauncher(tmp_path).spawn([sys.executable, "-c", _IGNORES_TERM],
                                                 dict(os.environ), log)
    while not _said(log, "UP"):
        await asyncio.sleep(0.02)
    return proc


async def test_a_group_the_agent_may_not_signal_does_not_fail_the_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EPERM from killpg (the group's processes changed user): the stop goes on and reports
    the process it could not end, it does not raise out of the owner's stop."""
    proc = await _ignoring_term(tmp_path)
    killpg = os.killpg

    def denied(pgid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    try:
        monkeypatch.setattr(os, "killpg", denied)
        info = await asyncio.wait_for(proc.stop(grace_s=0.1, kill_wait_s=0.2), 30)  # type: ignore[attr-defined]
        assert info.lingering
    finally:
        monkeypatch.undo()
        killpg(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        await asyncio.wait_for(proc.exited, 10)  # type: ignore[attr-defined]


async def test_a_stop_waits_its_grace_then_10_s_after_sigkill_at_most(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound the owner's stop (and an operator's deactivate) relies on: the grace, then at
    most 10 s for SIGKILL to take effect before the process is reported lingering."""
    proc = await _ignoring_term(tmp_path)
    waits: list[float] = []

    async def timing_out(awaitable: object, timeout: float) -> object:
        waits.append(timeout)
        raise TimeoutError

    try:
        proc.signal_group = lambda sig: None  # type: ignore[attr-defined]
        monkeypatch.setattr(asyncio, "wait_for", timing_out)
        info = await proc.stop(grace_s=7.5)  # type: ignore[attr-defined]
        monkeypatch.undo()
        assert waits == [7.5, 10.0] and info.lingering
    finally:
        monkeypatch.undo()
        os.killpg(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        await asyncio.wait_for(proc.exited, 10)  # type: ignore[attr-defined]


def test_a_descendant_that_cannot_be_killed_does_not_spare_the_others() -> None:
    class NotOurs:
        def is_running(self) -> bool:
            return True

        def kill(self) -> None:
            raise psutil.AccessDenied(1)

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        _kill_survivors([NotOurs(), psutil.Process(other.pid)])  # type: ignore[list-item]
        assert other.wait(10) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()


def test_a_burst_of_worker_lookups_shares_two_scans_and_none_misses_an_older_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """32 engines re-adopted at once each look for their workers: they share the process
    table's scans (two for a burst, not 32), yet each is given a scan that began after it
    asked, so a process that existed by then is in its answer."""
    import threading

    from engines import process
    from registry import identity

    scans: list[float] = []

    def counted() -> dict[int, identity.StatFields]:
        scans.append(time.monotonic())
        time.sleep(0.05)  # a scan long enough for the whole burst to queue behind it
        return identity.live_processes()

    monkeypatch.setattr(process, "live_processes", counted)
    table = process._SharedScan()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = threading.Barrier(16)
        answers: list[tuple[float, dict[int, identity.StatFields]]] = []

        def ask() -> None:
            start.wait()
            asked = time.monotonic()
            answers.append((asked, table.read(asked)))

        threads = [threading.Thread(target=ask) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(answers) == 16 and 1 <= len(scans) <= 2
        assert all(child.pid in got for _, got in answers)
        # each answer comes from a scan that began at or after its own question
        assert all(any(asked <= began for began in scans) for asked, _ in answers)
        later = time.monotonic()
        assert child.pid in table.read(later) and len(scans) <= 3  # a later ask scans again
        assert scans[-1] >= later
    finally:
        child.kill()
        child.wait()
