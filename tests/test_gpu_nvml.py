"""NvmlBackend against a fake pynvml and fake /proc trees: every shape and failure NVML has."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_agent.gpu.backend import GpuUnavailable
from runtime_agent.gpu.model import GpuProcess
from runtime_agent.gpu.nvml import NvmlBackend
from runtime_agent.gpu.pidmap import nspid_fields, read_pid_map, translate
from tests import fake_pynvml as fake
from tests.fake_pynvml import FakeGpu, FakeNvml

GIB = 1024**3
OUR_NS = "pid:[4026532001]"
OTHER_NS = "pid:[4026532999]"


def make_proc(root: Path, pid: int, nspid: list[int] | None, *, ns: str | None = OUR_NS,
              nvidia: bool = True) -> None:
    """One /proc/<pid> entry: status with an NSpid line, ns/pid link, fds."""
    entry = root / str(pid)
    (entry / "fd").mkdir(parents=True)
    lines = ["Name:\tpython3", f"Pid:\t{nspid[-1] if nspid else pid}"]
    if nspid is not None:
        lines.append("NSpid:\t" + "\t".join(str(p) for p in nspid))
    (entry / "status").write_text("\n".join(lines) + "\n")
    if ns is not None:
        (entry / "ns").mkdir()
        (entry / "ns" / "pid").symlink_to(ns)
    os.symlink("/dev/null", entry / "fd" / "0")
    if nvidia:
        os.symlink("/dev/nvidiactl", entry / "fd" / "3")
        os.symlink("/dev/nvidia0", entry / "fd" / "4")


def make_self(root: Path, ns: str = OUR_NS) -> None:
    (root / "self" / "ns").mkdir(parents=True)
    (root / "self" / "ns" / "pid").symlink_to(ns)


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    return root


# ---- construction ---------------------------------------------------------------------------

@pytest.mark.parametrize("code, words", [
    (fake.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1"),
    (fake.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
    (fake.NVML_ERROR_NO_PERMISSION, "no permission"),
    (fake.NVML_ERROR_UNKNOWN, "could not be initialised"),
])
def test_unusable_nvml_raises_gpu_unavailable_with_the_reason(code: int, words: str) -> None:
    with pytest.raises(GpuUnavailable, match=words):
        NvmlBackend(FakeNvml(init_error=code))


def test_no_device_is_unavailable_and_nvml_is_shut_down() -> None:
    nvml = FakeNvml(gpus=[])
    with pytest.raises(GpuUnavailable, match="no GPU"):
        NvmlBackend(nvml)
    assert nvml.initialised == 0


def test_the_real_binding_without_a_driver_is_unavailable() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        backend = NvmlBackend(pynvml)
    except GpuUnavailable as exc:
        assert "NVML" in str(exc) or "driver" in str(exc)
    else:  # a machine with a GPU: the real thing works
        assert backend.sample().devices
        backend.close()


# ---- devices --------------------------------------------------------------------------------

def test_devices_and_processes_in_our_own_namespace(proc: Path) -> None:
    make_proc(proc, 100, [100])
    make_proc(proc, 200, [200])
    nvml = FakeNvml([FakeGpu(used=30 * GIB, processes=[(100, 20 * GIB)]),
                     FakeGpu(name="NVIDIA H200", total=141 * GIB, used=11 * GIB,
                             processes=[(200, 10 * GIB)])])
    backend = NvmlBackend(nvml, proc_root=proc, clock=lambda: 42.0)
    sample = backend.sample()
    assert [(d.index, d.name, d.total_bytes, d.free_bytes, d.used_bytes, d.mig_mode)
            for d in sample.devices] == [
        (0, "NVIDIA H100 80GB HBM3", 80 * GIB, 50 * GIB, 30 * GIB, None),
        (1, "NVIDIA H200", 141 * GIB, 130 * GIB, 11 * GIB, None)]
    assert sample.devices[1].uuid.startswith("GPU-00000001")
    assert sample.processes == (GpuProcess(100, 0, 20 * GIB), GpuProcess(200, 1, 10 * GIB))
    assert sample.pid_mapping_ok and sample.error is None and sample.taken_at == 42.0


def test_nvml_is_initialised_once_for_many_samples(proc: Path) -> None:
    nvml = FakeNvml()
    backend = NvmlBackend(nvml, proc_root=proc)
    for _ in range(5):
        assert backend.sample().error is None
    assert backend.init_count == 1 and nvml.calls.count("nvmlInit") == 1
    backend.close()
    backend.close()
    assert nvml.initialised == 0 and nvml.calls.count("nvmlShutdown") == 1


def test_bytes_names_are_decoded(proc: Path) -> None:
    nvml = FakeNvml()
    setattr(nvml, "nvmlDeviceGetName", lambda handle: b"NVIDIA A100-SXM4-80GB")
    assert NvmlBackend(nvml, proc_root=proc).sample().devices[0].name == "NVIDIA A100-SXM4-80GB"


# ---- process queries ------------------------------------------------------------------------

V3, V2, V1 = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
              "nvmlDeviceGetComputeRunningProcesses")


@pytest.mark.parametrize("absent, not_in_driver, used", [
    (set(), set(), V3),
    ({V3}, set(), V2),  # an older binding
    (set(), {V3}, V2),  # an older driver
    ({V3, V2}, set(), V1),
    (set(), {V3, V2}, V1),
])
def test_process_query_falls_back_to_older_versions(proc: Path, absent: set[str],
                                                    not_in_driver: set[str], used: str) -> None:
    make_proc(proc, 100, [100])
    nvml = FakeNvml([FakeGpu(processes=[(100, GIB)])], absent=absent, not_in_driver=not_in_driver)
    sample = NvmlBackend(nvml, proc_root=proc).sample()
    assert sample.processes == (GpuProcess(100, 0, GIB),) and sample.error is None
    queries = [c for c in nvml.calls if c.startswith(V1)]
    assert queries[-1] == used


def test_no_process_query_at_all_is_reported_not_crashed(proc: Path) -> None:
    nvml = FakeNvml([FakeGpu(processes=[(100, GIB)])], not_in_driver={V3, V2, V1})
    sample = NvmlBackend(nvml, proc_root=proc).sample()
    assert sample.devices and sample.processes == ()
    assert sample.error is not None and "GPU 0" in sample.error


@pytest.mark.parametrize("raw", [False, True])
def test_used_memory_not_available_is_unknown_never_zero(proc: Path, raw: bool) -> None:
    make_proc(proc, 100, [100])
    nvml = FakeNvml([FakeGpu(processes=[(100, None)])], raw_not_available=raw)
    sample = NvmlBackend(nvml, proc_root=proc).sample()
    assert sample.processes == (GpuProcess(100, 0, None),)


def test_process_listing_not_permitted_leaves_devices_and_an_error(proc: Path) -> None:
    nvml = FakeNvml([FakeGpu(used=5 * GIB), FakeGpu()])
    backend = NvmlBackend(nvml, proc_root=proc)
    nvml.fail_once[V3] = fake.NVML_ERROR_NO_PERMISSION
    sample = backend.sample()
    assert len(sample.devices) == 2 and sample.error is not None
    assert "processes on GPU 0 cannot be listed" in sample.error and not sample.trustworthy
    assert backend.sample().error is None


# ---- PID namespaces -------------------------------------------------------------------------

def test_host_pids_are_mapped_through_nspid(proc: Path) -> None:
    make_self(proc)
    make_proc(proc, 5001, [5001, 7])  # we see the engine as 7, the host as 5001
    make_proc(proc, 5002, [5002, 9])
    make_proc(proc, 6000, [6000, 7], ns=OTHER_NS)  # another container's pid 7: not ours
    nvml = FakeNvml([FakeGpu(processes=[(5001, 3 * GIB), (5002, GIB), (6000, 2 * GIB),
                                        (7777, GIB)])])
    sample = NvmlBackend(nvml, proc_root=proc).sample()
    # 6000 and 7777 live outside our namespace: foreign, not an error
    assert sample.processes == (GpuProcess(7, 0, 3 * GIB), GpuProcess(9, 0, GIB))
    assert sample.pid_mapping_ok


def test_first_and_last_nspid_fields_are_used_for_deeper_nesting(proc: Path) -> None:
    make_proc(proc, 9001, [9001, 301, 12], ns=None)
    pid_map = read_pid_map(proc)
    assert pid_map.host_to_local == {9001: 12} and pid_map.nested


def test_host_pids_without_an_outer_procfs_make_mapping_impossible(proc: Path) -> None:
    make_self(proc)
    make_proc(proc, 7, [7])  # the container's own procfs: one level only
    nvml = FakeNvml([FakeGpu(processes=[(5001, 3 * GIB)])])  # NVML speaks host PIDs
    sample = NvmlBackend(nvml, proc_root=proc).sample()
    assert not sample.pid_mapping_ok and sample.processes == ()


def test_a_host_pid_equal_to_an_unrelated_local_pid_is_not_taken(proc: Path) -> None:
    make_proc(proc, 4242, [4242], nvidia=False)  # a local shell that happens to share the number
    make_proc(proc, 100, [100])
    nvml = FakeNvml([FakeGpu(processes=[(4242, GIB), (100, GIB)])])
    sample = NvmlBackend(nvml, proc_root=proc).sample()
    assert not sample.pid_mapping_ok
    assert sample.processes == (GpuProcess(100, 0, GIB),)


def test_nspid_parsing() -> None:
    assert nspid_fields("Name:\tx\nNSpid:\t12\t3\n") == [12, 3]
    assert nspid_fields("Name:\tx\n") is None
    assert nspid_fields("NSpid:\tbad\n") is None


def test_a_process_without_nspid_counts_as_its_directory_pid(proc: Path) -> None:
    make_proc(proc, 55, None)
    pid_map = read_pid_map(proc)
    assert pid_map.local_pids == {55} and not pid_map.nested
    assert translate([55], pid_map, proc).local == {55: 55}


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_real_kernel_nspid_maps_a_child_namespace(tmp_path: Path) -> None:
    """Inside a new PID namespace that still sees the outer procfs, the map gives host -> 1."""
    script = ("import json, os, sys; sys.path.insert(0, sys.argv[1]); "
              "from runtime_agent.gpu.pidmap import read_pid_map; from pathlib import Path; "
              "m = read_pid_map(Path('/proc')); "
              "print(json.dumps({'me': os.getpid(), 'map': m.host_to_local, 'nested': m.nested}))")
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", script, root],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot create a PID namespace here: {done.stderr.strip()[:200]}")
    seen = json.loads(done.stdout)
    assert seen["me"] == 1 and seen["nested"]
    assert 1 in {int(v) for v in seen["map"].values()}
    host_pid = next(int(k) for k, v in seen["map"].items() if int(v) == 1)
    assert host_pid > 1


# ---- MIG ------------------------------------------------------------------------------------

def test_mig_devices_report_mode_and_per_instance_memory(proc: Path) -> None:
    make_proc(proc, 100, [100])
    make_proc(proc, 101, [101])
    nvml = FakeNvml([
        FakeGpu(mig_capable=True, mig_enabled=True, used=30 * GIB,
                mig_instances=[[(100, 10 * GIB)], [(101, 20 * GIB)]]),
        FakeGpu(mig_capable=True, mig_enabled=False, processes=[(100, GIB)]),
        FakeGpu(mig_capable=False),
    ])
    sample = NvmlBackend(nvml, proc_root=proc).sample()
    assert [d.mig_mode for d in sample.devices] == [True, False, None]
    assert sample.processes == (GpuProcess(100, 0, 10 * GIB), GpuProcess(101, 0, 20 * GIB),
                                GpuProcess(100, 1, GIB))


def test_mig_instances_that_cannot_be_listed_fall_back_to_the_card(proc: Path) -> None:
    make_proc(proc, 100, [100])
    nvml = FakeNvml([FakeGpu(mig_capable=True, mig_enabled=True,
                             mig_instances=[[(100, 10 * GIB)]])],
                    absent={"nvmlDeviceGetMaxMigDeviceCount"})
    sample = NvmlBackend(nvml, proc_root=proc).sample()
    assert sample.processes == (GpuProcess(100, 0, None),)  # the card cannot say: unknown


# ---- errors and re-initialisation -----------------------------------------------------------

def test_an_error_mid_sample_is_reported_and_nvml_is_initialised_again(proc: Path) -> None:
    make_proc(proc, 100, [100])
    nvml = FakeNvml([FakeGpu(processes=[(100, GIB)]), FakeGpu()])
    backend = NvmlBackend(nvml, proc_root=proc)
    nvml.fail_once["nvmlDeviceGetMemoryInfo"] = fake.NVML_ERROR_GPU_IS_LOST
    failed = backend.sample()
    assert failed.devices == () and failed.processes == () and not failed.pid_mapping_ok
    assert failed.error is not None and "GPU is lost" in failed.error
    assert nvml.initialised == 0  # shut down after the error
    good = backend.sample()
    assert good.error is None and len(good.devices) == 2
    assert good.processes == (GpuProcess(100, 0, GIB),)
    assert backend.init_count == 2 and nvml.initialised == 1


def test_a_driver_that_forgot_us_is_initialised_again(proc: Path) -> None:
    nvml = FakeNvml()
    backend = NvmlBackend(nvml, proc_root=proc)
    nvml.initialised = 0  # e.g. a driver reload: every call is now Uninitialized
    assert backend.sample().error is not None
    assert backend.sample().error is None and backend.init_count == 2


def test_reinitialisation_failure_keeps_reporting_errors(proc: Path) -> None:
    nvml = FakeNvml()
    backend = NvmlBackend(nvml, proc_root=proc)
    nvml.fail_once["nvmlDeviceGetCount"] = fake.NVML_ERROR_UNKNOWN
    assert backend.sample().error is not None
    nvml.init_error = fake.NVML_ERROR_DRIVER_NOT_LOADED
    sample = backend.sample()
    assert sample.error is not None and "Driver Not Loaded" in sample.error
    nvml.init_error = None
    assert backend.sample().error is None
