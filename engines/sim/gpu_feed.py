"""Feeds the simulated GPU: the engine's memory, written to the channel whenever it changes.

A real engine's allocations are what NVML sees; a simulated engine reports its own (CUDA
context, weights, KV cache in use, weights offloaded to host memory) through
``engines.sim.gpu_report``, so the agent's simulated GPU backend follows the engine's real
lifecycle: load, sleep (weights to host memory, KV freed), wake, stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

from engines.sim.gpu_report import GpuReporter, channel_from_env, devices_from_env

CONTEXT_BYTES = 512 * 1024 * 1024  # a CUDA context and allocator slack, held while alive
POLL_S = 0.05


async def feed(memory: Callable[[], dict[str, int]], stop: asyncio.Event) -> None:
    """Report ``memory()`` until ``stop`` is set; remove the report on the way out."""
    reporter = GpuReporter(channel_from_env(os.environ), os.getpid(),
                           devices_from_env(os.environ))
    if reporter.path is None:
        return
    last: tuple[int, int, int] | None = None
    try:
        while not stop.is_set():
            now = memory()
            current = (now["weights_bytes"], now["kv_bytes"], now["host_bytes"])
            if current != last:
                reporter.update(current[0], current[1], CONTEXT_BYTES, current[2])
                last = current
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)
    finally:
        reporter.remove()
