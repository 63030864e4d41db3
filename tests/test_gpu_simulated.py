"""The simulated GPU backend and the simulated engine's report channel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.sim.gpu_report import (
    GpuReport,
    GpuReporter,
    channel_from_env,
    devices_from_env,
)
from runtime_agent.gpu import simulated
from runtime_agent.gpu.model import GpuProcess
from runtime_agent.gpu.simulated import (
    SimulatedGpuBackend,
    parse_spec,
    pid_alive,
    split_evenly,
)

GIB = 1024**3
MIB = 1024**2


# ---- the spec -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, expected", [
    ("1x80GiB", (1, 80 * GIB, "80GiB")),
    ("2x141GiB", (2, 141 * GIB, "141GiB")),
    ("8x80GiB", (8, 80 * GIB, "80GiB")),
    ("1x80GB", (1, 80 * 10**9, "80GB")),
    ("4x512MiB", (4, 512 * MIB, "512MiB")),
    ("1x4096B", (1, 4096, "4096B")),
    (" 2 X 1.5gib ", (2, int(1.5 * GIB), "1.5gib")),
])
def test_specs_parse(spec: str, expected: tuple[int, int, str]) -> None:
    assert parse_spec(spec) == expected


@pytest.mark.parametrize("spec, words", [
    ("80GiB", "COUNTxSIZE"), ("", "COUNTxSIZE"), ("2x", "COUNTxSIZE"), ("axbGiB", "COUNTxSIZE"),
    ("2x80XB", "is not a size"), ("0x80GiB", "at least one card"), ("1x0GiB", "positive size"),
])
def test_bad_specs_say_what_is_wrong(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_spec(spec)


def test_devices_from_a_spec(tmp_path: Path) -> None:
    sample = SimulatedGpuBackend("2x141GiB", tmp_path / "chan").sample()
    assert [(d.index, d.uuid, d.name, d.total_bytes, d.free_bytes, d.used_bytes, d.mig_mode)
            for d in sample.devices] == [
        (0, "GPU-sim-0000-0000-0000-000000000000", "Simulated GPU 141GiB", 141 * GIB, 141 * GIB,
         0, None),
        (1, "GPU-sim-0001-0000-0000-000000000000", "Simulated GPU 141GiB", 141 * GIB, 141 * GIB,
         0, None)]
    assert sample.processes == () and sample.pid_mapping_ok and sample.error is None


# ---- the channel ----------------------------------------------------------------------------

def test_engine_reports_become_processes_split_over_their_devices(tmp_path: Path) -> None:
    chan = tmp_path / "chan"
    backend = SimulatedGpuBackend("2x80GiB", chan, clock=lambda: 7.0, is_alive=lambda pid: True)
    GpuReporter(chan, 101, [0]).update(10 * GIB, 4 * GIB, 512 * MIB)
    GpuReporter(chan, 102, [0, 1]).update(20 * GIB + 1, 0, 0, host_bytes=3 * GIB)
    sample = backend.sample()
    assert sample.processes == (GpuProcess(101, 0, 14 * GIB + 512 * MIB),
                                GpuProcess(102, 0, 10 * GIB + 1), GpuProcess(102, 1, 10 * GIB))
    assert sample.devices[0].used_bytes == 24 * GIB + 512 * MIB + 1
    assert sample.devices[0].free_bytes == 80 * GIB - sample.devices[0].used_bytes
    assert sample.devices[1].used_bytes == 10 * GIB and sample.taken_at == 7.0
    assert backend.host_bytes() == {102: 3 * GIB}


def test_updates_replace_the_report(tmp_path: Path) -> None:
    chan = tmp_path / "chan"
    backend = SimulatedGpuBackend("1x80GiB", chan, is_alive=lambda pid: True)
    reporter = GpuReporter(chan, 101, [0])
    reporter.update(10 * GIB, 4 * GIB, 512 * MIB)
    reporter.update(0, 0, 512 * MIB, host_bytes=10 * GIB)  # level-1 sleep
    assert backend.sample().processes == (GpuProcess(101, 0, 512 * MIB),)
    reporter.remove()
    reporter.remove()
    assert backend.sample().processes == ()
    assert [p.name for p in chan.iterdir()] == []  # no temp file left behind


def test_over_commit_shows_and_free_never_goes_below_zero(tmp_path: Path) -> None:
    chan = tmp_path / "chan"
    backend = SimulatedGpuBackend("1x1GiB", chan, is_alive=lambda pid: True)
    GpuReporter(chan, 5, [0]).update(2 * GIB, 0, 0)
    device = backend.sample().devices[0]
    assert device.used_bytes == 2 * GIB and device.free_bytes == 0


def test_reports_of_dead_engines_are_dropped_and_removed(tmp_path: Path) -> None:
    chan = tmp_path / "chan"
    alive = {101}
    backend = SimulatedGpuBackend("1x80GiB", chan, is_alive=lambda pid: pid in alive)
    GpuReporter(chan, 101, [0]).update(GIB, 0, 0)
    GpuReporter(chan, 102, [0]).update(GIB, 0, 0)
    assert [p.pid for p in backend.sample().processes] == [101]
    assert sorted(p.name for p in chan.iterdir()) == ["101.json"]


def test_a_real_dead_process_is_recognised(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    chan = tmp_path / "chan"
    GpuReporter(chan, child.pid, [0]).update(GIB, 0, 0)
    GpuReporter(chan, os.getpid(), [0]).update(2 * GIB, 0, 0)
    sample = SimulatedGpuBackend("1x80GiB", chan).sample()
    assert sample.processes == (GpuProcess(os.getpid(), 0, 2 * GIB),)
    assert pid_alive(os.getpid()) and not pid_alive(child.pid)


def test_a_zombie_holds_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        assert not pid_alive(child.pid)
    finally:
        child.wait()


def test_bad_files_are_reported_and_temp_files_ignored(tmp_path: Path) -> None:
    chan = tmp_path / "chan"
    backend = SimulatedGpuBackend("1x80GiB", chan, is_alive=lambda pid: True)
    GpuReporter(chan, 101, [0]).update(GIB, 0, 0)
    (chan / "102.json").write_text("{not json")
    (chan / "103.json").write_text('{"pid": 999, "devices": [0]}')
    (chan / ".104.json.abc.tmp").write_text("half a rec")
    (chan / "notes.txt").write_text("hello")
    sample = backend.sample()
    assert sample.processes == (GpuProcess(101, 0, GIB),)
    assert sample.error is not None and "102.json" in sample.error and "103.json" in sample.error
    assert not sample.trustworthy


def test_devices_the_machine_lacks_are_an_error(tmp_path: Path) -> None:
    chan = tmp_path / "chan"
    backend = SimulatedGpuBackend("1x80GiB", chan, is_alive=lambda pid: True)
    GpuReporter(chan, 101, [0, 3]).update(2 * GIB, 0, 0)
    sample = backend.sample()
    assert sample.processes == (GpuProcess(101, 0, GIB),)
    assert sample.error is not None and "devices [0, 3]" in sample.error


def test_split_evenly_keeps_every_byte() -> None:
    assert split_evenly(10, 3) == [4, 3, 3] and sum(split_evenly(7 * GIB + 5, 8)) == 7 * GIB + 5


# ---- the reporter ---------------------------------------------------------------------------

def test_reporter_without_a_channel_does_nothing(tmp_path: Path) -> None:
    reporter = GpuReporter(None, 1, [0])
    reporter.update(GIB, GIB, GIB)
    reporter.remove()
    assert reporter.path is None


def test_report_round_trip_and_validation(tmp_path: Path) -> None:
    report = GpuReport(5, (0, 1), 1, 2, 3, 4)
    assert GpuReport.from_json(report.to_json()) == report and report.gpu_bytes == 6
    for text, words in [("[]", "not a JSON object"), ('{"pid": true, "devices": []}', "bad pid"),
                        ('{"pid": 3, "devices": [-1]}', "bad devices"),
                        ('{"pid": 3, "devices": [0], "kv_bytes": -5}', "bad kv_bytes")]:
        with pytest.raises(ValueError, match=words):
            GpuReport.from_json(text)
    with pytest.raises(ValueError, match="negative"):
        GpuReporter(tmp_path, 5, [0]).update(-1, 0, 0)


@pytest.mark.parametrize("value, devices", [
    (None, [0]), ("", [0]), ("  ", [0]), ("0", [0]), ("0,1", [0, 1]), (" 2 , 3 ", [2, 3]),
])
def test_devices_from_env(value: str | None, devices: list[int]) -> None:
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert devices_from_env(env) == devices


def test_devices_from_env_refuses_uuids() -> None:
    with pytest.raises(ValueError, match="not a device index"):
        devices_from_env({"CUDA_VISIBLE_DEVICES": "GPU-1234"})


def test_channel_from_env(tmp_path: Path) -> None:
    assert channel_from_env({}) is None and channel_from_env({"AIBRIX_SIM_GPU_DIR": ""}) is None
    assert channel_from_env({"AIBRIX_SIM_GPU_DIR": str(tmp_path)}) == tmp_path


# ---- reading the channel cheaply --------------------------------------------------------------

def test_an_unchanged_report_is_not_parsed_again(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample reads every engine's report; an unchanged file costs a stat, not a parse."""
    chan = tmp_path / "chan"
    parsed: list[str] = []

    class Counting:
        @staticmethod
        def from_json(text: str) -> GpuReport:
            parsed.append(text)
            return GpuReport.from_json(text)

    monkeypatch.setattr(simulated, "GpuReport", Counting)
    real_ns = simulated.time.time_ns
    backend = SimulatedGpuBackend("1x80GiB", chan, is_alive=lambda pid: True)
    reporter = GpuReporter(chan, 101, [0])
    reporter.update(GIB, 0, 0)
    # the file was written well before the read: its timestamps cannot hide a change
    monkeypatch.setattr(simulated.time, "time_ns", lambda: real_ns() + 10**9)
    assert backend.sample().processes == (GpuProcess(101, 0, GIB),)
    assert backend.sample().processes == (GpuProcess(101, 0, GIB),)
    assert len(parsed) == 1
    reporter.update(2 * GIB, 0, 0)  # replaced (a new file): read again
    assert backend.sample().processes == (GpuProcess(101, 0, 2 * GIB),)
    assert len(parsed) == 2


def test_a_report_rewritten_in_place_within_a_clock_tick_is_read_again(tmp_path: Path) -> None:
    """A file's timestamps may have the kernel's coarse clock: a rewrite of the same size right
    after a read may keep its inode, size and times, so a file that new is always read. (A
    kernel with fine-grained timestamps, 6.13 and later, shows the change anyway.)"""
    chan = tmp_path / "chan"
    chan.mkdir()
    backend = SimulatedGpuBackend("1x80GiB", chan, is_alive=lambda pid: True)
    path = chan / "101.json"
    path.write_text('{"pid": 101, "devices": [0], "weights_bytes": 1000}')
    assert backend.sample().processes == (GpuProcess(101, 0, 1000),)
    path.write_text('{"pid": 101, "devices": [0], "weights_bytes": 2000}')
    assert backend.sample().processes == (GpuProcess(101, 0, 2000),)
    path.write_text('{"pid": 101, "devices": [0], "weights_bytes": 3o00}')
    sample = backend.sample()
    assert sample.processes == () and sample.error is not None and "101.json" in sample.error
