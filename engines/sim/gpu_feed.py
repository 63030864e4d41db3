"""Feeds the simulated GPU: the engine's memory, written to the channel whenever it changes.

A real engine's allocations are what NVML sees; a simulated engine reports its own (CUDA
context, weights, KV cache in use, weights offloaded to host memory) through
``engines.sim.gpu_report``, so the agent's simulated GPU backend follows the engine's real
lifecycle: load, sleep (weights to host memory, KV freed), wake, stop.

As with a real engine, whose freed memory NVML shows the moment a sleep call returns, the
state writes the report itself (``flush``) on every lifecycle change before it answers, and the
KV cache on every change of what its requests hold. Nothing polls: a real engine spends nothing
for NVML to see its memory, and a 20 Hz poll here cost each idle engine about 1% of a core (64
engines: 0.6 of the 2 cores, all of it charged to the agent's runs against a floor whose
engines report nothing; ``bench.bench_mass_start``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from engines.sim.gpu_report import GpuReporter, channel_from_env, devices_from_env

CONTEXT_BYTES = 512 * 1024 * 1024  # a CUDA context and allocator slack, held while alive


class MemoryFeed:
    """Writes ``memory()`` to this process's report whenever it differs from the last one."""

    def __init__(self, memory: Callable[[], dict[str, int]]) -> None:
        self._memory = memory
        self._reporter = GpuReporter(channel_from_env(os.environ), os.getpid(),
                                     devices_from_env(os.environ))
        self._last: tuple[int, int, int] | None = None
        self._closed = False

    def flush(self) -> None:
        """Write the report now if the memory changed (a no-op without a channel)."""
        if self._reporter.path is None or self._closed:
            return
        now = self._memory()
        current = (now["weights_bytes"], now["kv_bytes"], now["host_bytes"])
        if current != self._last:
            self._reporter.update(current[0], current[1], CONTEXT_BYTES, current[2])
            self._last = current

    async def run(self, stop: asyncio.Event) -> None:
        """Write the report now, keep it until ``stop`` is set (each change is flushed by who
        made it), and remove it on the way out."""
        if self._reporter.path is None:
            return
        try:
            self.flush()
            await stop.wait()
        finally:
            self._closed = True
            self._reporter.remove()
