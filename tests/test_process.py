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
import sys  # noqa: E402

import psutil  # noqa: E402

from engines.process import ProcessLauncher  # noqa: E402

# A leader that traps SIGTERM (writing a marker), with one child in its group and one that left
# it (its own session), each printing its pid.
_TREE = r"""
import os, signal, subprocess, sys, time
marker = sys.argv[1]
def on_term(*_):
    open(marker, "w").write("term")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
away = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                        start_new_session=True)
print("PIDS", same.pid, away.pid, flush=True)
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
