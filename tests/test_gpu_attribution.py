"""Crediting GPU memory to engines, and finding an engine's whole process tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runtime_agent.gpu.attribution import (
    EngineMemory,
    EngineProcs,
    attribute,
    engine_memory,
    unattributed_bytes,
)
from runtime_agent.gpu.model import Device, GpuProcess, GpuSample
from runtime_agent.gpu.proctree import process_tree, process_trees

GIB = 1024**3


def dev(index: int, used: int, total: int = 80 * GIB) -> Device:
    return Device(index, f"GPU-{index}", "test", total, total - used, used, None)


def sample(processes: list[GpuProcess], *, ok: bool = True, error: str | None = None,
           used: tuple[int, ...] = (40 * GIB, 40 * GIB)) -> GpuSample:
    return GpuSample(tuple(dev(i, u) for i, u in enumerate(used)), tuple(processes), 1.0, ok,
                     error)


def test_sums_over_the_whole_tree_and_devices() -> None:
    s = sample([GpuProcess(10, 0, GIB), GpuProcess(11, 0, 20 * GIB), GpuProcess(11, 1, 20 * GIB),
                GpuProcess(30, 1, 5 * GIB)])
    got = attribute(s, {"a": EngineProcs(frozenset({10, 11, 12})),
                        "b": EngineProcs(frozenset({30}), devices=(1,))})
    assert got["a"] == EngineMemory(41 * GIB, {0: 21 * GIB, 1: 20 * GIB}, (0, 1))
    assert got["b"] == EngineMemory(5 * GIB, {1: 5 * GIB}, (1,))


def test_no_gpu_process_is_zero_only_when_mapping_works() -> None:
    procs = EngineProcs(frozenset({10}), devices=(0, 1))
    assert engine_memory(sample([]), procs) == EngineMemory(0, {0: 0, 1: 0}, (0, 1))
    assert engine_memory(sample([], ok=False), procs) == EngineMemory(None, {0: None, 1: None},
                                                                      (0, 1))
    assert engine_memory(sample([], ok=False), EngineProcs(frozenset({10}))).hbm_bytes is None


def test_one_unknown_process_makes_the_engine_unknown() -> None:
    s = sample([GpuProcess(10, 0, GIB), GpuProcess(11, 1, None)])
    got = engine_memory(s, EngineProcs(frozenset({10, 11})))
    assert got.hbm_bytes is None and got.per_device == {0: GIB, 1: None}


def test_an_incomplete_sample_credits_nobody() -> None:
    s = sample([GpuProcess(10, 0, GIB)], error="processes on GPU 1 cannot be listed")
    got = engine_memory(s, EngineProcs(frozenset({10})))
    assert got.hbm_bytes is None and got.per_device == {0: None}


def test_pinned_devices_without_processes_show_zero_and_observed_ones_are_added() -> None:
    s = sample([GpuProcess(10, 1, GIB)])
    got = engine_memory(s, EngineProcs(frozenset({10}), devices=(0,)))
    assert got == EngineMemory(GIB, {0: 0, 1: GIB}, (0, 1))


def test_unattributed_memory_is_what_no_engine_is_credited_with() -> None:
    s = sample([GpuProcess(10, 0, 30 * GIB), GpuProcess(11, 1, None), GpuProcess(99, 1, GIB)],
               used=(31 * GIB, 20 * GIB))
    memories = attribute(s, {"a": EngineProcs(frozenset({10})),
                             "b": EngineProcs(frozenset({11}))})
    # card 1: b is unknown, so its usage stays counted as someone else's (pessimistic)
    assert unattributed_bytes(s, memories) == {0: GIB, 1: 20 * GIB}


# ---- process trees --------------------------------------------------------------------------

TREE = """
import os, subprocess, sys, time
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
middle = os.fork()          # a double fork: the grandchild leaves the tree, stays in the session
if middle == 0:
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
os.waitpid(middle, 0)
print(kid.pid, flush=True)
time.sleep(60)
"""


def test_the_tree_holds_descendants_and_session_members(tmp_path: Path) -> None:
    engine = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert engine.stdout is not None
        kid = int(engine.stdout.readline())
        deadline = time.monotonic() + 10
        while True:  # until the middle process of the double fork is gone
            session = {p for p in _all_pids() if _sid(p) == engine.pid}
            if len(session) == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        tree = process_tree(engine.pid)
        assert {engine.pid, kid} <= tree
        assert session <= tree and len(tree) == 3  # the orphaned grandchild is still counted
        assert process_trees([engine.pid, os.getpid()])[engine.pid] == tree
        assert engine.pid in process_tree(os.getpid())  # our own child
    finally:
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
        assert engine.stdout is not None
        engine.stdout.close()


def test_a_vanished_process_has_an_empty_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_tree(child.pid) == frozenset()


def test_a_process_without_children_is_its_own_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_tree(child.pid) == {child.pid}
    finally:
        child.kill()
        child.wait()


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None
