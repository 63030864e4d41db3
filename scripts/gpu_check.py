#!/usr/bin/env python3
"""GPU check: does the agent credit an engine with the GPU memory it really holds?

Run on a GPU machine (PyTorch with CUDA and nvidia-ml-py installed):

    python scripts/gpu_check.py [--bytes 2147483648] [--device 0] [--proc-root /proc]

It starts two "engines" the way the agent does (own session, the CUDA work in a child process,
as vLLM's EngineCore): one only creates a CUDA context (its memory is the context overhead), the
other also allocates ``--bytes`` with ``torch.empty``. It then measures both through the agent's
own code (NvmlBackend -> process_trees -> attribute) and prints what each was credited with.
Exit 0: the allocating engine is credited within the context overhead of what it allocated;
1: attribution is off (or unknown); 2: no GPU, NVML or PyTorch here; 3: the test engines failed.
Inside a container, PIDs map only with hostPID or the host's /proc passed as --proc-root.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime_agent.gpu.attribution import EngineMemory, EngineProcs, attribute  # noqa: E402
from runtime_agent.gpu.backend import GpuUnavailable  # noqa: E402
from runtime_agent.gpu.model import GpuSample  # noqa: E402
from runtime_agent.gpu.nvml import NvmlBackend  # noqa: E402
from runtime_agent.gpu.proctree import process_trees  # noqa: E402

MIB = 1024**2
GIB = 1024**3
SLACK = 32 * MIB  # allocator granularity and per-process differences in context size
EXIT_OFF, EXIT_NO_GPU, EXIT_SETUP = 1, 2, 3


# ---- the test engines -----------------------------------------------------------------------

def worker(nbytes: int) -> None:
    """The CUDA work: a context, then ``nbytes`` in one tensor; hold it until stdin closes."""
    torch = importlib.import_module("torch")

    torch.zeros(1, device="cuda")  # create the context
    keep = torch.empty(nbytes, dtype=torch.uint8, device="cuda") if nbytes else None
    torch.cuda.synchronize()
    print(f"ready {os.getpid()} {torch.cuda.memory_reserved()}", flush=True)
    sys.stdin.read()  # the parent closes our stdin (or kills us) when done
    del keep


def engine(nbytes: int) -> None:
    """The engine's root process: holds no GPU memory, its child does (as vLLM's API server)."""
    child = subprocess.Popen([sys.executable, __file__, "--role", "worker", "--bytes",
                              str(nbytes)], stdin=subprocess.PIPE)
    sys.stdin.read()
    assert child.stdin is not None
    child.stdin.close()
    child.wait()


@dataclass
class Started:
    proc: subprocess.Popen[str]
    worker_pid: int
    torch_reserved: int  # what PyTorch's allocator holds in the worker (excludes the context)


def start_engine(nbytes: int, device: int, timeout_s: float) -> Started:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(device), CUDA_DEVICE_ORDER="PCI_BUS_ID")
    proc = subprocess.Popen([sys.executable, __file__, "--role", "engine", "--bytes",
                             str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("ready "):
        stop_engine(proc)
        raise RuntimeError(f"test engine ({nbytes} bytes) did not get ready in {timeout_s:.0f} s "
                           f"(exit {proc.returncode}); is PyTorch with CUDA installed?")
    _, pid, reserved = line.split()
    return Started(proc, int(pid), int(reserved))


def stop_engine(proc: subprocess.Popen[str], worker_pid: int | None = None) -> None:
    """Kill the engine's process group and wait until its worker is gone (its memory freed)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + 10
    while worker_pid is not None and time.monotonic() < deadline:
        try:
            if psutil.Process(worker_pid).status() == psutil.STATUS_ZOMBIE:
                break  # dead; its memory is free, reaping is its new parent's business
        except psutil.Error:
            break
        time.sleep(0.05)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


# ---- measuring ------------------------------------------------------------------------------

def measure(backend: NvmlBackend, roots: dict[str, int], settle_s: float
            ) -> tuple[GpuSample, dict[str, EngineMemory]]:
    """Sample until both engines are credited (NVML lags an allocation a little), then return."""
    deadline = time.monotonic() + settle_s
    while True:
        sample = backend.sample()
        trees = process_trees(roots.values())
        memories = attribute(sample, {k: EngineProcs(trees[pid]) for k, pid in roots.items()})
        known = all(m.hbm_bytes for m in memories.values())
        if known or time.monotonic() > deadline:
            return sample, memories
        time.sleep(0.5)


def verdict(allocated: int, attributed: int | None, overhead: int | None) -> tuple[bool, str]:
    """Pass when the engine is credited with what it allocated, give or take the context."""
    if attributed is None or overhead is None:
        return False, "attribution is unknown (see pid mapping and sample error above)"
    off = attributed - allocated
    limit = overhead + SLACK
    if abs(off) <= limit:
        return True, (f"OK: credited {fmt(attributed)} for {fmt(allocated)} allocated; off by "
                      f"{fmt(off)}, within the context overhead {fmt(overhead)} (+{fmt(SLACK)})")
    return False, (f"OFF: credited {fmt(attributed)} for {fmt(allocated)} allocated; off by "
                   f"{fmt(off)}, more than the context overhead {fmt(overhead)} (+{fmt(SLACK)})")


def fmt(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else f"{nbytes / MIB:,.0f} MiB"


def report(sample: GpuSample, memories: dict[str, EngineMemory], allocated: dict[str, int],
           started: dict[str, Started]) -> None:
    print(f"pid mapping ok: {sample.pid_mapping_ok}; sample error: {sample.error}")
    for d in sample.devices:
        print(f"GPU {d.index} {d.name} {d.uuid}: total {fmt(d.total_bytes)}, used "
              f"{fmt(d.used_bytes)}, free {fmt(d.free_bytes)}, MIG {d.mig_mode}")
    print(f"{'engine':<10} {'worker pid':>10} {'allocated':>12} {'torch held':>12} "
          f"{'attributed':>12} {'difference':>12}  per device")
    for key, memory in memories.items():
        diff = None if memory.hbm_bytes is None else memory.hbm_bytes - allocated[key]
        per = ", ".join(f"GPU {d}: {fmt(b)}" for d, b in sorted(memory.per_device.items()))
        print(f"{key:<10} {started[key].worker_pid:>10} {fmt(allocated[key]):>12} "
              f"{fmt(started[key].torch_reserved):>12} {fmt(memory.hbm_bytes):>12} "
              f"{fmt(diff):>12}  {per or '-'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--role", choices=["check", "engine", "worker"], default="check")
    parser.add_argument("--bytes", type=int, default=2 * GIB, help="bytes to allocate")
    parser.add_argument("--device", type=int, default=0, help="NVML index of the GPU to use")
    parser.add_argument("--proc-root", default="/proc", help="procfs for PID mapping")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to start engines")
    args = parser.parse_args(argv)
    if args.role == "worker":
        worker(args.bytes)
        return 0
    if args.role == "engine":
        engine(args.bytes)
        return 0
    try:
        backend = NvmlBackend(proc_root=args.proc_root)
    except GpuUnavailable as exc:
        print(f"gpu_check: no GPU to check: {exc}", file=sys.stderr)
        return EXIT_NO_GPU
    try:
        importlib.import_module("torch")  # only to fail early with a clear message
    except ImportError:
        print("gpu_check: PyTorch is not installed; it is needed to allocate GPU memory",
              file=sys.stderr)
        backend.close()
        return EXIT_NO_GPU
    started: dict[str, Started] = {}
    allocated = {"context": 0, "alloc": args.bytes}
    try:
        for key, nbytes in allocated.items():
            started[key] = start_engine(nbytes, args.device, args.timeout)
        roots = {k: s.proc.pid for k, s in started.items()}
        sample, memories = measure(backend, roots, settle_s=10.0)
    except RuntimeError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return EXIT_SETUP
    finally:
        for s in started.values():
            stop_engine(s.proc, s.worker_pid)
        backend.close()
    report(sample, memories, allocated, started)
    if not sample.pid_mapping_ok:
        print("PID mapping failed: NVML reports host PIDs this procfs cannot translate; run with "
              "hostPID, or mount the host's /proc and pass --proc-root", file=sys.stderr)
    ok, message = verdict(args.bytes, memories["alloc"].hbm_bytes, memories["context"].hbm_bytes)
    print(message)
    return 0 if ok else EXIT_OFF


if __name__ == "__main__":
    sys.exit(main())
