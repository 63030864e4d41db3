"""scripts/gpu_check.py without a GPU: its verdict, its no-GPU exit, and a dry run of its engines
(a stand-in ``torch`` and a backend that reports the workers' memory as NVML would)."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest

from runtime_agent.gpu.backend import GpuUnavailable
from runtime_agent.gpu.model import Device, GpuProcess, GpuSample
from runtime_agent.gpu.nvml import NvmlBackend

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024**2
GIB = 1024**3
CONTEXT = 500 * MIB


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_verdict() -> None:
    check = load_script()
    assert check.verdict(2 * GIB, 2 * GIB + CONTEXT, CONTEXT)[0]
    assert check.verdict(2 * GIB, 2 * GIB, CONTEXT)[0]
    ok, message = check.verdict(2 * GIB, 3 * GIB, CONTEXT)
    assert not ok and message.startswith("OFF")
    assert not check.verdict(2 * GIB, None, CONTEXT)[0]
    assert not check.verdict(2 * GIB, 2 * GIB, None)[0]


def test_no_gpu_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        NvmlBackend().close()
    except GpuUnavailable:
        pass
    else:
        pytest.skip("this machine has a GPU")
    assert load_script().main([]) == 2
    assert "no GPU to check" in capsys.readouterr().err


FAKE_TORCH = """
uint8 = "uint8"

def zeros(*args, **kwargs):
    return None

def empty(n, **kwargs):
    return bytearray(1)

class cuda:
    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def memory_reserved():
        return 0
"""


def ours(tmp_path: Path) -> list[psutil.Process]:
    """The processes this test started: they carry its PYTHONPATH (the fake torch), whoever
    their parent is now; another test's beside this one (pytest -n) do not."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("PYTHONPATH") == str(tmp_path):
                found.append(proc)
    return found


class WorkerReportingBackend:
    """Reports every gpu_check worker of this test as NVML would: its bytes plus a CUDA context,
    and ``extra`` more for a worker that allocates (an attribution error to be caught)."""

    name = "fake"

    def __init__(self, ours: Path, extra: int = 0) -> None:
        self.ours, self.extra = ours, extra

    def sample(self) -> GpuSample:
        procs = []
        for proc in ours(self.ours):
            cmd = proc.info["cmdline"] or []
            if "worker" in cmd and "--bytes" in cmd:
                nbytes = int(cmd[cmd.index("--bytes") + 1])
                extra = self.extra if nbytes else 0
                procs.append(GpuProcess(proc.pid, 0, nbytes + CONTEXT + extra))
        used = sum(p.used_bytes or 0 for p in procs)
        return GpuSample((Device(0, "GPU-x", "Fake", 80 * GIB, 80 * GIB - used, used, None),),
                         tuple(procs), 0.0, True)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("extra, code", [(0, 0), (GIB, 1)])
def test_dry_run_through_the_agent_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str], extra: int,
                                        code: int) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    check = load_script()

    def backend(**kwargs: Any) -> WorkerReportingBackend:
        return WorkerReportingBackend(tmp_path, extra=extra)

    monkeypatch.setattr(check, "NvmlBackend", backend)
    before = {p.pid for p in ours(tmp_path)}
    assert check.main(["--bytes", str(GIB), "--timeout", "60"]) == code
    out = capsys.readouterr().out
    assert ("OK: credited" if code == 0 else "OFF: credited") in out
    assert "alloc" in out and "context" in out
    leftovers = [p for p in ours(tmp_path) if p.pid not in before and p.info["status"] != psutil.STATUS_ZOMBIE
                 and "gpu_check.py" in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
