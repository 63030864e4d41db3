"""A stand-in for the ``pynvml`` module (nvidia-ml-py) with the real API's shapes and failures.

Shapes reproduced: ``NVMLError(code)`` returns the code's subclass (``NVMLError_LibraryNotFound``
...) with ``.value``; every call before ``nvmlInit`` or after ``nvmlShutdown`` raises
``NVMLError_Uninitialized``; names and UUIDs are ``str``; memory info has ``total/free/used``;
``nvmlDeviceGetMigMode`` returns ``[current, pending]`` or raises NOT_SUPPORTED on cards without
MIG; process queries return objects with ``pid``, ``usedGpuMemory`` (None when not available, or
the raw unsigned maximum as old bindings left it), ``gpuInstanceId`` and ``computeInstanceId``.
Functions can be made absent (``AttributeError``, an older binding) or absent from the driver
(``NVMLError_FunctionNotFound``), and one-shot errors can be injected into any call.
"""

from __future__ import annotations

from ctypes import c_ulonglong
from dataclasses import dataclass, field
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_VALUE_NOT_AVAILABLE_ulonglong = c_ulonglong(-1)
RAW_NOT_AVAILABLE = NVML_VALUE_NOT_AVAILABLE_ulonglong.value

_NAMES = {NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
          NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
          NVML_ERROR_NOT_FOUND: "Not Found", NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
          NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
          NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found", NVML_ERROR_GPU_IS_LOST: "GPU is lost",
          NVML_ERROR_UNKNOWN: "Unknown Error"}


class NVMLError(Exception):
    _by_code: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._by_code.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int | None = None) -> None:
        super().__init__(self.value)

    def __str__(self) -> str:
        return _NAMES.get(self.value, f"NVML Error with code {self.value}")


def _subclass(name: str, code: int) -> type[NVMLError]:
    def new(cls: type[NVMLError], *args: Any) -> NVMLError:
        return NVMLError.__new__(cls, code)

    made = type(name, (NVMLError,), {"__new__": new})
    NVMLError._by_code[code] = made
    return made


NVMLError_Uninitialized = _subclass("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_NotSupported = _subclass("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _subclass("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotFound = _subclass("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_DriverNotLoaded = _subclass("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_LibraryNotFound = _subclass("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_FunctionNotFound = _subclass("NVMLError_FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND)
NVMLError_GpuIsLost = _subclass("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)


class NVMLLibraryMismatchError(Exception):
    pass


class FriendlyObject:
    """What pynvml's ``nvmlStructToFriendlyObject`` returns: the struct's fields as attributes."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 80 * 1024**3
    used: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes or None)
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_instances: list[list[tuple[int, int | None]]] = field(default_factory=list)


@dataclass
class _Handle:
    index: int
    mig_slot: int | None = None


class FakeNvml:
    """An object that behaves like the ``pynvml`` module; pass it as ``nvml_module``."""

    def __init__(self, gpus: list[FakeGpu] | None = None, *, init_error: int | None = None,
                 absent: set[str] | None = None, not_in_driver: set[str] | None = None,
                 raw_not_available: bool = False) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.init_error = init_error
        self.absent = absent or set()  # attributes the binding lacks (AttributeError)
        self.not_in_driver = not_in_driver or set()  # symbols the driver lacks
        self.raw_not_available = raw_not_available  # old binding: no None conversion
        self.fail_once: dict[str, int] = {}  # function name -> NVML error code, raised once
        self.initialised = 0  # init refcount, as NVML keeps it
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "absent"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:  # module constants and error classes
        value = globals().get(name)
        if value is None or name.startswith("_"):
            raise AttributeError(name)
        return value

    # ---- plumbing -------------------------------------------------------------------------

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if name in self.not_in_driver:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        if name not in ("nvmlInit", "nvmlShutdown") and self.initialised <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        code = self.fail_once.pop(name, None)
        if code is not None:
            raise NVMLError(code)

    def _gpu(self, handle: _Handle) -> FakeGpu:
        return self.gpus[handle.index]

    def _procs(self, procs: list[tuple[int, int | None]]) -> list[FriendlyObject]:
        out = []
        for pid, used in procs:
            if used is None and self.raw_not_available:
                used = RAW_NOT_AVAILABLE
            out.append(FriendlyObject(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF,
                                      computeInstanceId=0xFFFFFFFF))
        return out

    # ---- the API --------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        if self.initialised <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._enter("nvmlDeviceGetName")
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._enter("nvmlDeviceGetUUID")
        return f"GPU-{handle.index:08x}-fake-4000-8000-000000000000"

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> FriendlyObject:
        self._enter("nvmlDeviceGetMemoryInfo")
        gpu = self._gpu(handle)
        return FriendlyObject(total=gpu.total, free=gpu.total - gpu.used, used=gpu.used)

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        self._enter("nvmlDeviceGetMigMode")
        gpu = self._gpu(handle)
        if not gpu.mig_capable:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        mode = NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount")
        return 7 if self._gpu(handle).mig_capable else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        if index >= len(self._gpu(handle).mig_instances):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return _Handle(handle.index, index)

    def _running(self, name: str, handle: _Handle) -> list[FriendlyObject]:
        self._enter(name)
        gpu = self._gpu(handle)
        if handle.mig_slot is not None:
            return self._procs(gpu.mig_instances[handle.mig_slot])
        if gpu.mig_enabled:  # the parent card: the processes, without their memory
            return self._procs([(pid, None) for inst in gpu.mig_instances for pid, _ in inst])
        return self._procs(gpu.processes)

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: _Handle) -> list[FriendlyObject]:
        return self._running("nvmlDeviceGetComputeRunningProcesses_v3", handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: _Handle) -> list[FriendlyObject]:
        return self._running("nvmlDeviceGetComputeRunningProcesses_v2", handle)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[FriendlyObject]:
        # recent bindings route the unversioned call to _v3 and raise a mismatch error when the
        # driver lacks it; the test decides with `not_in_driver`
        if "nvmlDeviceGetComputeRunningProcesses" in self.not_in_driver:
            self.calls.append("nvmlDeviceGetComputeRunningProcesses")
            raise NVMLLibraryMismatchError("Unversioned function called and the pyNVML version "
                                           "does not match the NVML lib version")
        return self._running("nvmlDeviceGetComputeRunningProcesses", handle)
