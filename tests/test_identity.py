"""Process identity checks against real child processes: a reused PID is never adopted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry import identity
from registry.identity import (
    FoundEngine,
    Verdict,
    parse_environ,
    parse_stat,
    pid_namespace_pids,
    process_start_time,
    read_environ,
    scan_engines,
    verify,
)
from registry.env import ENV_ENGINE_ID, ENV_ENGINE_SPEC, ENV_STATE_DIR

SLEEP = "import time; time.sleep(60)"
# A child that starts a grandchild (inheriting its environment) and prints the grandchild's PID.
SPAWN_WORKER = (
    "import subprocess, sys, time\n"
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(w.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def engine_env(engine_id: str | None, state_dir: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIBRIX_")}
    if engine_id is not None:
        env[ENV_ENGINE_ID] = engine_id
    if state_dir is not None:
        env[ENV_STATE_DIR] = state_dir
    env[ENV_ENGINE_SPEC] = '{"model_name": "m"}'
    return env


@contextmanager
def spawn(
    code: str = SLEEP,
    engine_id: str | None = "abcdef12",
    state_dir: str | None = "/state",
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[str]]:
    """Start a child (Python running ``code`` unless ``argv`` is given) in its own process
    group; kill the whole group afterwards."""
    proc = subprocess.Popen(
        argv or [sys.executable, "-c", code],
        env=engine_env(engine_id, state_dir) if env is None else env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def read_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


def wait_for_state(pid: int, state: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while read_state(pid) != state:
        assert time.monotonic() < deadline, f"process {pid} never reached state {state}"
        time.sleep(0.01)


def start_time_of(proc: subprocess.Popen[str]) -> int:
    start = process_start_time(proc.pid)
    assert start is not None
    return start


# --- verify -----------------------------------------------------------------------------------


def test_a_live_engine_matches_its_pid_start_time_and_engine_id() -> None:
    with spawn() as proc:
        assert verify(proc.pid, start_time_of(proc), "abcdef12") is Verdict.MATCH


def test_the_start_time_is_the_kernel_start_time_psutil_also_reports() -> None:
    with spawn() as proc:
        ticks = start_time_of(proc)
        boot = psutil.boot_time()
        created = boot + ticks / os.sysconf("SC_CLK_TCK")
        assert created == pytest.approx(psutil.Process(proc.pid).create_time(), abs=1.0)
        assert ticks >= (process_start_time(os.getpid()) or 0)


def test_a_different_start_time_means_the_pid_was_reused() -> None:
    with spawn() as proc:
        start = start_time_of(proc)
        assert verify(proc.pid, start - 1, "abcdef12") is Verdict.REUSED
        assert verify(proc.pid, start + 1, "abcdef12") is Verdict.REUSED


def test_a_different_engine_id_means_the_pid_was_reused() -> None:
    with spawn(engine_id="0123456789") as proc:
        assert verify(proc.pid, start_time_of(proc), "abcdef12") is Verdict.REUSED


def test_a_process_without_an_engine_id_is_not_an_engine() -> None:
    with spawn(engine_id=None) as proc:
        assert verify(proc.pid, start_time_of(proc), "abcdef12") is Verdict.REUSED


def test_a_process_checked_the_moment_it_was_spawned_matches_every_time() -> None:
    # Right after Popen returns, the kernel may still be inside exec and /proc shows an empty
    # environment for a few milliseconds; that must not read as "another process".
    for _ in range(40):
        with spawn(argv=["sleep", "60"]) as proc:
            assert verify(proc.pid, start_time_of(proc), "abcdef12") is Verdict.MATCH
        with spawn(argv=["sleep", "60"]) as proc:
            env = read_environ(proc.pid)
            assert env is not None and env[ENV_ENGINE_ID] == "abcdef12"


def test_a_process_with_an_empty_environment_is_not_an_engine() -> None:
    with spawn(argv=["sleep", "60"], env={}) as proc:
        started = time.monotonic()
        assert verify(proc.pid, start_time_of(proc), "abcdef12") is Verdict.REUSED
        assert read_environ(proc.pid) == {}
        assert time.monotonic() - started < identity.EXEC_SETTLE_S


def test_an_exec_that_never_finishes_reads_as_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    real_read_at = identity._read_at

    def read_at(dir_fd: int, name: str) -> bytes:
        if name == "environ":
            return b""
        if name == "stat":
            line = real_read_at(dir_fd, name).decode()
            head, _, tail = line.rpartition(")")
            rest = tail.split()
            rest[51 - 3] = "0"  # env_end: the new image has no environment yet
            return f"{head}) {' '.join(rest)}\n".encode()
        return real_read_at(dir_fd, name)

    monkeypatch.setattr(identity, "_read_at", read_at)
    monkeypatch.setattr(identity, "EXEC_SETTLE_S", 0.05)
    with spawn() as proc:
        assert verify(proc.pid, start_time_of(proc), "abcdef12") is Verdict.UNREADABLE
        assert read_environ(proc.pid) is None


def test_a_killed_and_reaped_process_is_gone() -> None:
    with spawn() as proc:
        start = start_time_of(proc)
        proc.kill()
        proc.wait()
        assert verify(proc.pid, start, "abcdef12") is Verdict.GONE
        assert process_start_time(proc.pid) is None
        assert read_environ(proc.pid) is None
        assert pid_namespace_pids(proc.pid) is None


def test_a_zombie_is_gone() -> None:
    with spawn() as proc:
        start = start_time_of(proc)
        proc.send_signal(signal.SIGKILL)
        wait_for_state(proc.pid, "Z")  # killed, not reaped
        assert verify(proc.pid, start, "abcdef12") is Verdict.GONE
        assert process_start_time(proc.pid) is None
        assert read_environ(proc.pid) is None


def test_an_unreadable_environment_is_reported_as_unreadable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_read_at = identity._read_at

    def read_at(dir_fd: int, name: str) -> bytes:
        if name == "environ":
            raise PermissionError(13, "Permission denied", name)
        return real_read_at(dir_fd, name)

    monkeypatch.setattr(identity, "_read_at", read_at)
    with spawn() as proc:
        assert verify(proc.pid, start_time_of(proc), "abcdef12") is Verdict.UNREADABLE
        assert read_environ(proc.pid) is None


@pytest.mark.parametrize("pid", [0, -1, "minus ours", 2**22 + 12345])
def test_impossible_pids_are_gone(pid: int | str) -> None:
    # minus our own pid: kill(2) would take it as our process group (computed here, so the
    # test's id is the same in every pytest-xdist worker)
    pid = -os.getpid() if pid == "minus ours" else int(pid)
    assert verify(pid, 1, "abcdef12") is Verdict.GONE
    assert process_start_time(pid) is None
    assert read_environ(pid) is None
    assert pid_namespace_pids(pid) is None


def test_read_environ_returns_what_the_agent_put_in() -> None:
    with spawn(engine_id="feedface", state_dir="/var/lib/agent") as proc:
        env = read_environ(proc.pid)
        assert env is not None
        assert env[ENV_ENGINE_ID] == "feedface"
        assert env[ENV_STATE_DIR] == "/var/lib/agent"
        assert env[ENV_ENGINE_SPEC] == '{"model_name": "m"}'


# --- parsing ------------------------------------------------------------------------------------


def stat_line(
    pid: int,
    comm: str,
    state: str,
    ppid: int,
    start_time: int,
    flags: int = 0x400100,
    env_end: int = 140726631784429,
) -> str:
    """A 52-field stat line shaped like the kernel's, with recognisable filler numbers."""
    fields = [str(pid), f"({comm})", state, str(ppid)] + [str(100 + i) for i in range(5, 53)]
    fields[8] = str(flags)  # fields are 1-based in proc(5)
    fields[21] = str(start_time)
    fields[50] = str(env_end)
    return " ".join(fields) + "\n"


@pytest.mark.parametrize(
    "comm",
    ["python", "a b)c", ") (", "x) S 1 2 3 (y", "((()))", "", "  ", "kworker/0:1H-kb"],
)
def test_stat_lines_parse_whatever_the_command_name_contains(comm: str) -> None:
    fields = parse_stat(stat_line(42, comm, "S", 7, 123456789))
    assert (fields.comm, fields.state, fields.ppid, fields.start_time) == (comm, "S", 7, 123456789)


@given(
    comm=st.text(alphabet=st.characters(exclude_characters="\0\n", exclude_categories=["Cs"])),
    ppid=st.integers(min_value=0, max_value=2**22),
    start_time=st.integers(min_value=0, max_value=2**64),
)
def test_any_command_name_parses(comm: str, ppid: int, start_time: int) -> None:
    fields = parse_stat(stat_line(1, comm, "R", ppid, start_time))
    assert (fields.comm, fields.ppid, fields.start_time) == (comm, ppid, start_time)


def test_stat_tells_an_exec_in_progress_from_a_kernel_thread_and_a_settled_process() -> None:
    settled = parse_stat(stat_line(5, "sleep", "S", 1, 10))
    mid_exec = parse_stat(stat_line(5, "sleep", "R", 1, 10, env_end=0))
    kthread = parse_stat(stat_line(2, "kthreadd", "S", 0, 1, flags=0x208040, env_end=0))
    assert (settled.exec_in_progress, settled.is_kernel_thread) == (False, False)
    assert (mid_exec.exec_in_progress, mid_exec.is_kernel_thread) == (True, False)
    assert (kthread.exec_in_progress, kthread.is_kernel_thread) == (False, True)


def test_a_short_stat_line_from_an_old_kernel_still_parses() -> None:
    line = " ".join(stat_line(9, "x y", "S", 1, 777).split()[:44])
    fields = parse_stat(line)
    assert (fields.start_time, fields.env_end, fields.exec_in_progress) == (777, None, False)


@pytest.mark.parametrize("line", ["", "1 python S 1", "1 (python) S 1 2 3"])
def test_malformed_stat_lines_raise(line: str) -> None:
    with pytest.raises(ValueError):
        parse_stat(line)


def test_a_real_process_named_with_spaces_and_parentheses_is_identified() -> None:
    code = "open('/proc/self/comm', 'w').write('a b) c (d')\nprint('ready', flush=True)\n" + SLEEP
    with spawn(code) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        stat = parse_stat(Path(f"/proc/{proc.pid}/stat").read_text())
        assert stat.comm == "a b) c (d"
        assert stat.ppid == os.getpid()
        assert stat.start_time == start_time_of(proc)
        assert verify(proc.pid, stat.start_time, "abcdef12") is Verdict.MATCH


def test_environ_parsing_handles_odd_entries() -> None:
    raw = b"A=1\0B=x=y\0NOEQUALS\0=novalue\0A=2\0EMPTY=\0BIN=\xff\xfe\0\0"
    env = parse_environ(raw)
    assert env == {"A": "1", "B": "x=y", "EMPTY": "", "BIN": os.fsdecode(b"\xff\xfe")}
    assert parse_environ(b"") == {}


# --- namespaces ---------------------------------------------------------------------------------


def test_the_namespace_pid_list_starts_with_the_pid_this_proc_shows() -> None:
    pids = pid_namespace_pids(os.getpid())
    assert pids is not None and pids[0] == os.getpid()
    with spawn() as proc:
        child_pids = pid_namespace_pids(proc.pid)
        assert child_pids is not None and child_pids[0] == proc.pid
        assert len(child_pids) == len(pids)


# --- scan ---------------------------------------------------------------------------------------


def test_scan_finds_engine_top_processes_but_not_workers_that_inherited_the_environment(
    tmp_path: Path,
) -> None:
    state = str(tmp_path)
    with (
        spawn(SPAWN_WORKER, engine_id="aaaaaaaa", state_dir=state) as engine,
        spawn(SLEEP, engine_id="bbbbbbbb", state_dir=state) as other,
        spawn(SLEEP, engine_id="cccccccc", state_dir=state + "-other-agent"),
        spawn(SLEEP, engine_id=None, state_dir=state),
    ):
        assert engine.stdout is not None
        worker_pid = int(engine.stdout.readline())
        worker_env = read_environ(worker_pid)
        assert worker_env is not None and worker_env[ENV_ENGINE_ID] == "aaaaaaaa"

        found = scan_engines(state)

        assert [f.pid for f in found] == sorted([engine.pid, other.pid])
        by_pid = {f.pid: f for f in found}
        assert by_pid[engine.pid] == FoundEngine(
            pid=engine.pid, start_time=start_time_of(engine), environ=by_pid[engine.pid].environ,
            pgid=os.getpgid(engine.pid))
        assert by_pid[engine.pid].environ[ENV_ENGINE_ID] == "aaaaaaaa"
        assert by_pid[other.pid].environ[ENV_ENGINE_ID] == "bbbbbbbb"
        assert scan_engines(Path(state)) == found


def test_scan_reports_an_orphaned_worker_of_a_dead_engine_as_its_top_process(
    tmp_path: Path,
) -> None:
    state = str(tmp_path)
    with spawn(SPAWN_WORKER, engine_id="aaaaaaaa", state_dir=state) as engine:
        assert engine.stdout is not None
        worker_pid = int(engine.stdout.readline())
        engine.kill()
        engine.wait()
        assert [(f.pid, f.environ[ENV_ENGINE_ID]) for f in scan_engines(state)] == [
            (worker_pid, "aaaaaaaa")
        ]


def test_scan_ignores_zombies(tmp_path: Path) -> None:
    with spawn(SLEEP, state_dir=str(tmp_path)) as proc:
        proc.send_signal(signal.SIGKILL)
        wait_for_state(proc.pid, "Z")
        assert scan_engines(str(tmp_path)) == []


def test_scan_tolerates_processes_vanishing_mid_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with spawn(SLEEP, state_dir=str(tmp_path)) as live, spawn(SLEEP) as doomed:
        doomed.kill()
        doomed.wait()
        real_listdir = os.listdir

        def listdir(path: str) -> list[str]:
            names = real_listdir(path)
            return [str(doomed.pid), *names] if path == "/proc" else names

        monkeypatch.setattr(os, "listdir", listdir)
        assert [f.pid for f in scan_engines(str(tmp_path))] == [live.pid]


def test_scan_stays_exact_while_the_engine_forks_constantly(tmp_path: Path) -> None:
    churn = (
        "import subprocess\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    subprocess.run(['true'])\n"
    )
    with spawn(churn, state_dir=str(tmp_path)) as engine:
        assert engine.stdout is not None and engine.stdout.readline() == "ready\n"
        for _ in range(50):
            assert [f.pid for f in scan_engines(str(tmp_path))] == [engine.pid]
