"""What one look at the GPUs saw: devices, the processes holding their memory, and how sure we are.

Every GPU backend (NVML on a real machine, the simulated one fed by simulated engines) returns the
same frozen values, so attribution, the ledger and the snapshot never know which backend ran.
Unknown is kept apart from zero everywhere: a process whose usage NVML cannot report has
``used_bytes=None``, and a sample whose process list cannot be trusted says so
(``pid_mapping_ok=False`` or ``error``), so no engine is ever reported as using 0 bytes by accident.
"""

from __future__ import annotations

from msgspec import Struct



class Device(Struct, frozen=True):
    """One physical GPU as NVML numbers it (the index engines see with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""

    index: int
    uuid: str
    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    mig_mode: bool | None  # None: the card has no MIG (NVML said "not supported")


class GpuProcess(Struct, frozen=True):
    """One process holding memory on one device; ``pid`` is in the agent's own PID namespace."""

    pid: int
    device_index: int
    used_bytes: int | None  # None: NVML said "not available" (unknown, never 0)


class GpuSample(Struct, frozen=True):
    """The result of one ``GpuBackend.sample()``.

    ``pid_mapping_ok`` is False when NVML reported a process whose PID cannot be placed in our PID
    namespace: then no engine can be credited with GPU memory (attribution reports unknown).
    ``error`` is None for a complete sample; otherwise it says what went wrong: with ``devices``
    empty the whole sample failed, with devices present only the process lists are incomplete.
    """

    devices: tuple[Device, ...]
    processes: tuple[GpuProcess, ...]
    taken_at: float
    pid_mapping_ok: bool
    error: str | None = None

    def device(self, index: int) -> Device | None:
        """The device with this NVML index, or None when the sample has none."""
        return next((d for d in self.devices if d.index == index), None)

    @property
    def trustworthy(self) -> bool:
        """Whether per-process figures may be credited to engines (complete and mapped)."""
        return self.error is None and self.pid_mapping_ok
