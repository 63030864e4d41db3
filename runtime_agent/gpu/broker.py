"""The memory broker: the agent's one view of GPU and host memory, and the one place it is spent.

It samples the GPU backend (NVML, or the simulated GPU) right after every engine transition
and on an interval that backs off, up to ``steady_cap_s``, while samples see no change
(``runtime_agent.cadence``), attributes each GPU process to an engine by process tree, and
keeps the GPU and host ledgers. Activations and wakes claim memory here before they start
(claim first, so two never spend the same free bytes), waiting callers are woken by memory
changes (an engine stopping, sleeping, or measured smaller), never by a timer, and readers
(snapshot, metrics) get the figures of the last sample: a scrape never calls NVML.

Ledger changes are plain function calls with no ``await`` between decision and store, so the
broker needs no lock. Sampling (NVML, /proc) runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from msgspec import Struct
from msgspec.structs import replace
import psutil

from contract.clock import Clock, LoopClock
from contract.reasons import INSUFFICIENT_GPU
from runtime_agent.cadence import Cadence, next_interval
from runtime_agent.gpu.admission import Admit, Refuse, admit_sleep, claim
from runtime_agent.gpu.attribution import (
    EngineMemory,
    EngineProcs,
    attribute,
    unattributed_bytes,
)
from runtime_agent.gpu.backend import GpuBackend
from runtime_agent.gpu.gate import DeviceGate
from runtime_agent.gpu.host_ledger import HostLedger, host_observe, host_release
from runtime_agent.gpu.ledger import (
    GpuLedger,
    declare,
    forget,
    ledger_for,
    measure,
    observe,
    refresh,
    release,
    reserve,
    set_sleeping,
)
from runtime_agent.gpu.model import GpuSample
from runtime_agent.gpu.proctree import process_trees
from runtime_agent.loops import Throttled, wait_event

log = logging.getLogger(__name__)


class EngineRef(Struct, frozen=True):
    """What the broker needs to know of one engine at sampling time."""

    pid: int | None
    devices: tuple[int, ...]
    sleeping: bool
    steady: bool  # active or asleep with no operation in flight: a measurement is its footprint
    since: float | None = None  # its last transition: a ref equal after a sample saw no change


class EngineHbm(Struct, frozen=True):
    hbm_bytes: int | None = None
    hbm_peak_bytes: int | None = None
    sleeping_footprint_bytes: int | None = None
    host_rss_bytes: int | None = None
    per_device: Mapping[int, int | None] | None = None


class _Taken(Struct, frozen=True):
    sample: GpuSample
    trees: dict[int, frozenset[int]]
    rss: dict[int, int]
    host_total: int
    host_available: int
    seconds: float


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _same_memory(a: GpuSample | None, b: GpuSample | None) -> bool:
    """Two samples that saw the same memory on the same devices and processes."""
    return (a is not None and b is not None
            and replace(a, taken_at=0.0) == replace(b, taken_at=0.0))


def _rss(pid: int) -> int:
    """Resident bytes of one process from ``/proc/<pid>/statm`` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _take(backend: GpuBackend, roots: list[int]) -> _Taken:
    started = time.perf_counter()
    sample = backend.sample()
    trees = process_trees(roots)
    rss = {root: sum(_rss(pid) for pid in pids) for root, pids in trees.items()}
    vm = psutil.virtual_memory()
    return _Taken(sample, trees, rss, vm.total, vm.available, time.perf_counter() - started)


class MemoryBroker:
    def __init__(self, backend: GpuBackend, engines: Callable[[], Mapping[str, EngineRef]],
                 reserve_bytes: int = 0, host_reserve_bytes: int = 0,
                 interval_s: float = 1.0, steady_cap_s: float | None = None,
                 clock: Clock | None = None) -> None:
        self.backend = backend
        self._clock = clock or LoopClock()  # the sampling interval and callers' waits
        self.gate = DeviceGate()
        self._engines = engines
        self._reserve = reserve_bytes
        self._interval = interval_s
        self._cadence = Cadence(interval_s, max(interval_s, steady_cap_s or interval_s))
        self.sample: GpuSample | None = None
        self.ledger = GpuLedger(devices={})
        self.host = HostLedger(total_bytes=0, reserve_bytes=host_reserve_bytes)
        self.host_available = 0
        self.figures: dict[str, EngineHbm] = {}
        self._peaks: dict[str, tuple[int | None, int]] = {}
        self._asleep: set[str] = set()  # engines told asleep (a sleep began or was observed)
        self._changed = asyncio.Event()
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.samples_total = 0
        self.sample_seconds_total = 0.0
        self._throttled = Throttled(log)  # a failing sample is reported once per interval

    # ---- sampling ---------------------------------------------------------------------------

    async def start(self) -> None:
        await self.sample_now()
        self._task = asyncio.create_task(self._loop(), name="gpu-sampler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.backend.close)

    def poke(self) -> None:
        """Sample soon: something changed (a transition, a finished sleep or wake)."""
        self._poke.set()

    async def _loop(self) -> None:
        interval = self._interval
        while True:
            changed = await wait_event(self._poke, interval, self._clock)
            self._poke.clear()
            before = self.sample
            try:
                await self.sample_now()
            except Exception as exc:  # noqa: BLE001 - a bad sample must not end sampling
                changed = True
                self._throttled.warning("gpu-sample", "GPU sample failed (%s: %s)",
                                        type(exc).__name__, exc)
            changed = changed or not _same_memory(before, self.sample)
            interval = next_interval(self._cadence, interval, changed)

    async def sample_now(self) -> None:
        refs = dict(self._engines())
        roots = [r.pid for r in refs.values() if r.pid is not None]
        taken = await asyncio.to_thread(_take, self.backend, roots)
        self.samples_total += 1
        self.sample_seconds_total += taken.seconds
        self._apply(taken, refs)

    def _apply(self, taken: _Taken, taken_for: Mapping[str, EngineRef]) -> None:
        """Apply a sample. An engine whose state changed while the sample was taken (a wake
        or sleep began or ended, its process exited) may be measured on either side of the
        change: its figures are refreshed, never taken as its footprint."""
        after = self._engines()
        refs = {k: r if after.get(k) == r else replace(r, steady=False)
                for k, r in taken_for.items()}
        sample = taken.sample
        if sample.error and not sample.devices:
            log.warning("GPU sample failed: %s", sample.error)
            return
        self.sample = sample
        before = {d: self.ledger.room(d) for d in self.ledger.devices}
        ledger = self.ledger if self.ledger.devices else ledger_for(sample.devices, self._reserve)
        procs = {k: EngineProcs(taken.trees.get(r.pid, frozenset()) if r.pid else frozenset(),
                                r.devices or None) for k, r in refs.items()}
        memories = attribute(sample, procs)
        ledger = observe(ledger, sample.devices, unattributed_bytes(sample, memories))
        for key, mem in memories.items():
            ref = refs[key]
            if key in ledger.holdings and ref.pid is not None:
                ledger = (measure if ref.steady else refresh)(ledger, key, mem)
            self.figures[key] = self._figures_for(key, ref, mem, taken.rss.get(ref.pid or -1))
        self.ledger = ledger
        held = sum(self.host.holdings.values())
        self.host_available = taken.host_available
        self.host = host_observe(self.host, taken.host_total,
                                 max(0, taken.host_total - taken.host_available - held))
        if any(self.ledger.room(d) > room for d, room in before.items()):
            self._signal()

    def _figures_for(self, key: str, ref: EngineRef, mem: EngineMemory,
                     rss: int | None) -> EngineHbm:
        pid, peak = self._peaks.get(key, (None, 0))
        if pid != ref.pid:  # a new process: its peak starts again
            peak = 0
        if mem.hbm_bytes is not None:
            peak = max(peak, mem.hbm_bytes)
        self._peaks[key] = (ref.pid, peak)
        old = self.figures.get(key, EngineHbm())
        sleeping_fp = old.sleeping_footprint_bytes
        if ref.sleeping and ref.steady and mem.hbm_bytes is not None:
            sleeping_fp = mem.hbm_bytes  # measured after each sleep
        known = mem.hbm_bytes is not None or peak > 0
        return EngineHbm(hbm_bytes=mem.hbm_bytes, hbm_peak_bytes=peak if known else None,
                         sleeping_footprint_bytes=sleeping_fp, host_rss_bytes=rss,
                         per_device=dict(mem.per_device))

    # ---- claims -----------------------------------------------------------------------------

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout_s: float) -> None:
        """Return at the next memory change (or after ``timeout_s``)."""
        await wait_event(self._changed, timeout_s, self._clock)

    def claim_start(self, key: str, need_bytes: int, n_devices: int) -> Admit | Refuse:
        result = claim(need_bytes, n_devices, self.ledger, key, declared_bytes=need_bytes)
        if isinstance(result, Refuse):
            return result
        self.ledger = result[0]
        return result[1]

    async def claim_start_waiting(self, key: str, need_bytes: int, n_devices: int,
                                  wait_s: float) -> Admit | Refuse:
        """Claim now, or wait up to ``wait_s`` for memory to change and claim then."""
        deadline = self._clock.now() + wait_s
        while True:
            result = self.claim_start(key, need_bytes, n_devices)
            left = deadline - self._clock.now()
            if isinstance(result, Admit) or result.reason != INSUFFICIENT_GPU or left <= 0:
                return result
            await wait_event(self._changed, left, self._clock)

    def adopt(self, key: str, devices: tuple[int, ...], declared_bytes: int,
              sleeping: bool) -> None:
        """An engine that already runs (re-adopted): charged its declaration until measured."""
        valid = tuple(d for d in devices if d in self.ledger.devices)
        if valid:
            self.ledger = declare(self.ledger, key, valid, declared_bytes, sleeping)

    def adopt_peak(self, key: str, pid: int, peak_bytes: int) -> None:
        """A re-adopted engine's HBM peak as the previous agent recorded it for process
        ``pid``: its peak goes on from there (a new process starts again)."""
        self._peaks[key] = (pid, peak_bytes)

    def claim_wake(self, key: str) -> Admit | Refuse | None:
        """Claim back what the engine held awake; None when it is not in the ledger."""
        holding = self.ledger.holdings.get(key)
        if holding is None:
            return None
        need = max(holding.wake_need(d) for d in holding.devices)
        result = claim(need, len(holding.devices), self.ledger, key)
        if isinstance(result, Refuse):
            return result
        self.ledger = result[0]
        return result[1]

    def wake_is_sized(self, key: str) -> bool:
        """Whether the ledger knows what a wake of ``key`` allocates (its last awake measurement
        on every card, or a declaration): such a wake may share its cards' turn (gate.py)."""
        holding = self.ledger.holdings.get(key)
        return holding is not None and all(holding.wake_need(d) > 0 for d in holding.devices)

    def exited(self, key: str) -> None:
        """The engine's process is gone but it will restart: it keeps its place on its cards."""
        holding = self.ledger.holdings.get(key)
        if holding is not None:
            need = max(holding.wake_need(d) for d in holding.devices)
            result = reserve(self.ledger, key, holding.devices, need)
            if not isinstance(result, tuple):  # does not fit any more: keep the declaration
                return
            self.ledger = result[0]

    def release_claim(self, key: str) -> None:
        if key in self.ledger.holdings:
            self.ledger = release(self.ledger, key)
            self._signal()

    def stopped(self, key: str) -> None:
        self.ledger = forget(self.ledger, key)
        self.host = host_release(self.host, key)
        self.figures.pop(key, None)
        self._peaks.pop(key, None)
        self._asleep.discard(key)
        self._signal()

    def admit_sleep(self, key: str, level: int) -> Refuse | None:
        """Level 1 moves weights to host memory: claim room there (level 2 needs none)."""
        figures = self.figures.get(key)
        holding = self.ledger.holdings.get(key)
        weights = holding.declared_bytes if holding is not None else 0
        if figures is not None and figures.hbm_bytes is not None:
            weights = figures.hbm_bytes  # an upper bound of what goes to host memory
        result = admit_sleep(level, weights, self.host, key)
        if isinstance(result, Refuse):
            return result
        self.host = result
        return None

    def set_sleeping(self, key: str, sleeping: bool) -> None:
        """The engine is asleep (a sleep began, or a probe or readiness says so) or awake.

        Only a new sleep forgets the footprint: an earlier sleep's is not this one's, so it is
        unknown until the next steady sample measures it. A health probe that confirms an
        engine still asleep (every probe interval) changes nothing: clearing the figure there
        left it null until the next sample, at most polls when probes follow samples."""
        if key in self.ledger.holdings:
            self.ledger = set_sleeping(self.ledger, key, sleeping)
        if not sleeping:
            self._asleep.discard(key)
            self.host = host_release(self.host, key)
            return
        if key in self._asleep:
            return
        self._asleep.add(key)
        if (figures := self.figures.get(key)) is not None:
            self.figures[key] = replace(figures, sleeping_footprint_bytes=None)

    # ---- readers ----------------------------------------------------------------------------

    def accelerators(self) -> list[dict[str, Any]]:
        if self.sample is None:
            return []
        used: dict[int, int] = {}
        for fig in self.figures.values():
            for d, b in (fig.per_device or {}).items():
                used[d] = used.get(d, 0) + (b or 0)
        out = []
        for dev in self.sample.devices:
            claims = sum(max(0, h.claim_bytes - h.base(dev.index))
                         for h in self.ledger.holdings.values() if dev.index in h.devices)
            budget = self.ledger.devices.get(dev.index)
            out.append({"id": dev.uuid, "index": dev.index, "name": dev.name,
                        "mig_mode": dev.mig_mode, "hbm_total_bytes": dev.total_bytes,
                        "hbm_free_bytes": dev.free_bytes, "hbm_used_bytes": dev.used_bytes,
                        "hbm_used_by_engines_bytes": used.get(dev.index, 0),
                        "hbm_reserved_bytes": claims,
                        "hbm_usable_bytes": budget.usable_bytes if budget else None,
                        "hbm_room_bytes": self.ledger.room(dev.index) if budget else None,
                        "gate_waiters": self.gate.waiters(dev.index)})
        return out

    def node(self) -> dict[str, Any]:
        return {"gpu_backend": self.backend.name,
                "host_memory_total_bytes": self.host.total_bytes,
                "host_memory_available_bytes": self.host_available,
                "host_memory_claimed_bytes": sum(self.host.holdings.values()),
                "gpu_pid_mapping_ok": self.sample.pid_mapping_ok if self.sample else None,
                "gpu_samples_total": self.samples_total,
                "gpu_sample_seconds_total": round(self.sample_seconds_total, 6)}

