"""The simulated engine's side of simulated NVML: it states what GPU and host memory it holds.

A real engine's memory is seen by NVML; a simulated engine allocates nothing, so it writes what it
*would* hold to ``<AIBRIX_SIM_GPU_DIR>/<pid>.json`` and the agent's simulated GPU backend reads
those files as NVML's process list. The file is replaced atomically (temp file + rename), so the
reader never sees half a record. This module owns the file format; the reader
(``runtime_agent.gpu.simulated``) parses it with ``GpuReport.from_json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

from msgspec import Struct
from msgspec.structs import asdict

from contract.numbers import whole_number

CHANNEL_ENV = "AIBRIX_SIM_GPU_DIR"
_FIELDS = ("weights_bytes", "kv_bytes", "context_bytes", "host_bytes")


class GpuReport(Struct, frozen=True):
    """One engine's memory: GPU bytes are weights + KV + CUDA context, split over ``devices``."""

    pid: int
    devices: tuple[int, ...]
    weights_bytes: int = 0
    kv_bytes: int = 0
    context_bytes: int = 0
    host_bytes: int = 0  # weights offloaded to host memory by a level-1 sleep

    @property
    def gpu_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.context_bytes

    def to_json(self) -> str:
        data = asdict(self)
        data["devices"] = list(self.devices)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GpuReport:
        """Parse a channel file; ValueError (with the reason) when it is not a valid report."""
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        pid, devices = data.get("pid"), data.get("devices")
        if not _is_int(pid) or pid <= 0:
            raise ValueError(f"bad pid {pid!r}")
        if not isinstance(devices, list) or not all(_is_int(d) and d >= 0 for d in devices):
            raise ValueError(f"bad devices {devices!r}")
        sizes = {name: data.get(name, 0) for name in _FIELDS}
        for name, value in sizes.items():
            if not _is_int(value) or value < 0:
                raise ValueError(f"bad {name} {value!r}")
        return cls(pid=pid, devices=tuple(devices), **sizes)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class GpuReporter:
    """Writes this engine's report; every method is a no-op without a channel directory."""

    def __init__(self, channel_dir: Path | None, pid: int, devices: list[int]) -> None:
        self.channel_dir = channel_dir
        self.pid = pid
        self.devices = tuple(devices)

    @property
    def path(self) -> Path | None:
        return None if self.channel_dir is None else self.channel_dir / f"{self.pid}.json"

    def update(self, weights_bytes: int, kv_bytes: int, context_bytes: int,
               host_bytes: int = 0) -> None:
        """Replace the report atomically with these figures (bytes, never negative)."""
        path = self.path
        if path is None:
            return
        report = GpuReport(self.pid, self.devices, weights_bytes, kv_bytes, context_bytes,
                           host_bytes)
        for name in _FIELDS:
            if getattr(report, name) < 0:
                raise ValueError(f"{name} must not be negative")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(report.to_json())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def remove(self) -> None:
        """Withdraw the report (the engine exits or holds nothing any more)."""
        path = self.path
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def devices_from_env(env: Mapping[str, str]) -> list[int]:
    """The GPU indices of ``CUDA_VISIBLE_DEVICES`` ("0,1" -> [0, 1]); unset or empty -> [0].

    Only integer indices are simulated; anything else (a GPU UUID) is a ValueError naming it.
    """
    raw = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not raw:
        return [0]
    devices: list[int] = []
    for part in raw.split(","):
        token = part.strip()
        index = whole_number(token)
        if index is None:
            raise ValueError(f"CUDA_VISIBLE_DEVICES={raw!r}: {token!r} is not a device index "
                             "(the simulation understands only indices like '0,1')")
        devices.append(index)
    return devices


def channel_from_env(env: Mapping[str, str]) -> Path | None:
    """The channel directory from ``AIBRIX_SIM_GPU_DIR``; None (report nothing) when unset."""
    raw = env.get(CHANNEL_ENV, "").strip()
    return Path(raw) if raw else None
