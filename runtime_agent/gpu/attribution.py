"""Crediting GPU memory to engines: pure arithmetic over one sample and each engine's processes.

vLLM's memory is held by its EngineCore (and, with tensor parallelism, its workers), children of
the process the agent started, so an engine's HBM is the sum over its whole process tree. The rule
that matters: unknown is never reported as 0. An engine is credited ``None`` when the sample
cannot be trusted (a driver error, or PIDs that cannot be placed in our namespace) or when NVML
could not say what one of its processes uses; 0 only when the mapping works and the engine truly
holds no GPU memory.
"""

from __future__ import annotations

from collections.abc import Mapping

from msgspec import Struct

from runtime_agent.gpu.model import GpuSample


class EngineProcs(Struct, frozen=True):
    """An engine's whole process tree (local PIDs) and the devices it is pinned to, if known
    (``CUDA_VISIBLE_DEVICES`` with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so indices match NVML's)."""

    pids: frozenset[int]
    devices: tuple[int, ...] | None = None


class EngineMemory(Struct, frozen=True):
    """What an engine holds: in total, per device, and on which devices (pinned and observed)."""

    hbm_bytes: int | None
    per_device: Mapping[int, int | None]
    devices: tuple[int, ...]


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


def engine_memory(sample: GpuSample, procs: EngineProcs) -> EngineMemory:
    """The memory one engine holds according to ``sample`` (see the module doc for None)."""
    per_device: dict[int, int | None] = {d: 0 for d in procs.devices or ()}
    for proc in sample.processes:
        if proc.pid in procs.pids:
            per_device[proc.device_index] = _add(per_device.get(proc.device_index, 0),
                                                 proc.used_bytes)
    if not sample.trustworthy:
        per_device = {d: None for d in per_device}
    devices = tuple(sorted(per_device))
    total: int | None = 0 if sample.trustworthy else None
    for value in per_device.values():
        total = _add(total, value)
    return EngineMemory(total, per_device, devices)


def attribute(sample: GpuSample, engines: Mapping[str, EngineProcs]) -> dict[str, EngineMemory]:
    """``engine_memory`` for every engine, by the same key."""
    return {key: engine_memory(sample, procs) for key, procs in engines.items()}


def unattributed_bytes(sample: GpuSample, memories: Mapping[str, EngineMemory]) -> dict[int, int]:
    """Per device, the used memory no engine is credited with: other processes, the driver's own
    reserve, and (pessimistically) engines whose usage is unknown. The ledger counts it as held
    by someone else; counting unknown usage twice may refuse a request that would have fit, but
    never admits one that would not."""
    credited: dict[int, int] = {d.index: 0 for d in sample.devices}
    for memory in memories.values():
        for device, value in memory.per_device.items():
            if value is not None and device in credited:
                credited[device] += value
    return {d.index: max(0, d.used_bytes - credited[d.index]) for d in sample.devices}
