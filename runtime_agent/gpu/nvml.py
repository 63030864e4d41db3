"""The real GPU backend: device memory and per-process usage from NVML (``pynvml``).

Why each rule exists:

* NVML is initialised once per backend life and again only after an NVML error (a driver reload
  or a lost GPU), never per sample: ``nvmlInit`` costs tens of milliseconds and takes driver locks.
* A missing library, an unloaded driver or no device at all raise ``GpuUnavailable`` at
  construction, so the agent can fall back to simulation with a clear reason.
* ``nvmlDeviceGetComputeRunningProcesses_v3`` is asked first; an older driver or binding lacks it
  (``AttributeError`` or ``NVMLError_FunctionNotFound``), so ``_v2`` and then the plain call follow.
* ``usedGpuMemory`` may be "not available" (None, or the unsigned-64-bit maximum on old bindings):
  that is unknown, never 0.
* NVML reports host PIDs inside containers; ``pidmap`` places them in our namespace or reports
  that it cannot (``pid_mapping_ok=False``).
* On a MIG-enabled card per-process memory is asked of each MIG instance (the parent card often
  reports it as not available); the processes are credited to the parent card's index.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime_agent.gpu.backend import GpuUnavailable
from runtime_agent.gpu.model import Device, GpuProcess, GpuSample
from runtime_agent.gpu.pidmap import read_pid_map, translate

ULL_MAX = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE as an unsigned long long
_PROCESS_QUERIES = ("nvmlDeviceGetComputeRunningProcesses_v3",
                    "nvmlDeviceGetComputeRunningProcesses_v2",
                    "nvmlDeviceGetComputeRunningProcesses")
# NVML return codes (the values of pynvml's NVML_ERROR_* constants; read from the module if present)
_CODES = {"UNINITIALIZED": 1, "NOT_SUPPORTED": 3, "NO_PERMISSION": 4, "NOT_FOUND": 6,
          "DRIVER_NOT_LOADED": 9, "LIBRARY_NOT_FOUND": 12, "FUNCTION_NOT_FOUND": 13}

RawProcess = tuple[int, int, int | None]  # (NVML pid, device index, bytes or None)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _used(value: Any) -> int | None:
    if value is None:
        return None
    used = int(value)
    return None if used < 0 or used >= ULL_MAX else used


class NvmlBackend:
    """``GpuBackend`` over NVML. ``nvml_module`` lets tests pass a fake ``pynvml``."""

    name = "nvml"

    def __init__(self, nvml_module: Any = None, proc_root: str | Path = "/proc",
                 clock: Callable[[], float] = time.time) -> None:
        if nvml_module is None:
            try:
                nvml_module = importlib.import_module("pynvml")
            except ImportError as exc:
                raise GpuUnavailable("the NVML binding is not installed (pip install "
                                     "nvidia-ml-py)") from exc
        self._nvml = nvml_module
        self._proc_root = Path(proc_root)
        self._clock = clock
        self._initialised = False
        self._lock = threading.Lock()  # sample() runs in a worker thread; close() may not race it
        self.init_count = 0  # how often NVML was initialised (tests and diagnostics)
        try:
            self._init()
            count = int(self._nvml.nvmlDeviceGetCount())
        except self._nvml.NVMLError as exc:
            self._shutdown()
            raise GpuUnavailable(self._unavailable_reason(exc)) from exc
        if count == 0:
            self._shutdown()
            raise GpuUnavailable("NVML is loaded but reports no GPU on this machine")

    # ---- NVML life ------------------------------------------------------------------------

    def _code(self, name: str) -> int:
        return int(getattr(self._nvml, f"NVML_ERROR_{name}", _CODES[name]))

    def _is(self, exc: BaseException, name: str) -> bool:
        return getattr(exc, "value", None) == self._code(name)

    def _unavailable_reason(self, exc: BaseException) -> str:
        if self._is(exc, "LIBRARY_NOT_FOUND"):
            return ("NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver is visible to "
                    "this container")
        if self._is(exc, "DRIVER_NOT_LOADED"):
            return "the NVIDIA kernel driver is not loaded"
        if self._is(exc, "NO_PERMISSION"):
            return "no permission to use NVML (the device files are not accessible)"
        return f"NVML could not be initialised: {exc}"

    def _init(self) -> None:
        if not self._initialised:
            self._nvml.nvmlInit()
            self._initialised = True
            self.init_count += 1

    def close(self) -> None:
        with self._lock:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._initialised:
            self._initialised = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass  # the driver already dropped us; nothing left to release

    # ---- sampling -------------------------------------------------------------------------

    def sample(self) -> GpuSample:
        with self._lock:
            return self._sample()

    def _sample(self) -> GpuSample:
        taken_at = self._clock()
        try:
            self._init()
            devices, raw, problems = self._read_devices()
        except self._nvml.NVMLError as exc:
            self._shutdown()  # initialise afresh on the next sample
            return GpuSample((), (), taken_at, False,
                             f"NVML error: {exc} (NVML will be initialised again)")
        processes, mapping_ok = self._to_local(raw)
        return GpuSample(tuple(devices), processes, taken_at, mapping_ok,
                         "; ".join(problems) if problems else None)

    def _read_devices(self) -> tuple[list[Device], list[RawProcess], list[str]]:
        nvml = self._nvml
        devices: list[Device] = []
        raw: list[RawProcess] = []
        problems: list[str] = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            mig = self._mig_mode(handle)
            devices.append(Device(index, _text(nvml.nvmlDeviceGetUUID(handle)),
                                  _text(nvml.nvmlDeviceGetName(handle)), int(memory.total),
                                  int(memory.free), int(memory.used), mig))
            try:
                handles = self._mig_handles(handle) if mig else []
                for h in handles or [handle]:
                    raw.extend((int(p.pid), index, _used(getattr(p, "usedGpuMemory", None)))
                               for p in self._processes(h))
            except nvml.NVMLError as exc:
                if not any(self._is(exc, c) for c in ("NOT_SUPPORTED", "NO_PERMISSION",
                                                      "FUNCTION_NOT_FOUND")):
                    raise
                problems.append(f"processes on GPU {index} cannot be listed: {exc}")
        return devices, raw, problems

    def _mig_mode(self, handle: Any) -> bool | None:
        getter = getattr(self._nvml, "nvmlDeviceGetMigMode", None)
        if getter is None:
            return None
        try:
            current, _pending = getter(handle)
        except self._nvml.NVMLError as exc:
            if self._is(exc, "NOT_SUPPORTED") or self._is(exc, "FUNCTION_NOT_FOUND"):
                return None
            raise
        return int(current) == int(getattr(self._nvml, "NVML_DEVICE_MIG_ENABLE", 1))

    def _mig_handles(self, handle: Any) -> list[Any]:
        """The MIG instances of a card; empty when they cannot be listed (then the card is asked)."""
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        except (AttributeError, nvml.NVMLError):
            return []
        handles = []
        for slot in range(count):
            try:
                handles.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
            except nvml.NVMLError as exc:
                if not self._is(exc, "NOT_FOUND"):  # an empty slot is NOT_FOUND
                    raise
        return handles

    def _processes(self, handle: Any) -> list[Any]:
        last: BaseException | None = None
        for name in _PROCESS_QUERIES:
            query = getattr(self._nvml, name, None)
            if query is None:
                continue
            try:
                return list(query(handle))
            except self._nvml.NVMLError as exc:
                if not self._is(exc, "FUNCTION_NOT_FOUND"):
                    raise
                last = exc
            except Exception as exc:  # pynvml's NVMLLibraryMismatchError: binding newer than driver
                if type(exc).__name__ != "NVMLLibraryMismatchError":
                    raise
                last = exc
        raise self._nvml.NVMLError(self._code("FUNCTION_NOT_FOUND")) from last

    def _to_local(self, raw: list[RawProcess]) -> tuple[tuple[GpuProcess, ...], bool]:
        if not raw:
            return (), True
        translation = translate((pid for pid, _, _ in raw), read_pid_map(self._proc_root),
                                self._proc_root)
        processes = tuple(GpuProcess(translation.local[pid], device, used)
                          for pid, device, used in raw if pid in translation.local)
        return processes, translation.ok
