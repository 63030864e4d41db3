"""Mutable state of one simulated engine: request slots, sleep state and its Prometheus metrics.

vLLM's scheduler runs at most ``max_num_seqs`` requests at once and queues the rest; supervisors judge
idleness from ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``. This module keeps those
counts honest (a request is *waiting* until it holds a slot, *running* while it does) and owns the
sleep/wake state, so the HTTP layer stays a thin translation of requests into these calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from engines.sim.kvcache import KvCache
from engines.sim.options import SimOptions

FINISHED_REASONS = ("stop", "length", "abort")


class EngineAsleep(Exception):
    """Inference was attempted while the engine sleeps (or is going to sleep or waking)."""


class WakeFailed(Exception):
    """The simulated wake-up failed (``--sim-fail-wake``); the engine is still asleep."""


class EngineState:
    """The one place that knows whether the engine sleeps and how many requests it holds."""

    def __init__(self, options: SimOptions) -> None:
        self.options = options
        self.sleeping = False
        self.sleep_level = 0  # 0 while awake, else the level of the current sleep
        self.transition: str | None = None  # "sleeping" / "waking" while a call is in progress
        self.running = 0
        self.waiting = 0
        self.success_total = 0
        self._slots = asyncio.Semaphore(options.max_running)
        self.kv: KvCache | None = None  # present when the engine runs with kvcached
        if options.kvcached_ipc_name is not None:
            self.kv = KvCache(options.kvcached_ipc_name, options.kvcached_shm_dir, options.kv_capacity_bytes,
                              options.kv_request_bytes)
        self._transition_lock = asyncio.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": options.served_model_name}
        self._running_gauge = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            ["model_name"],
            registry=self.registry,
        ).labels(**labels)
        self._waiting_gauge = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            ["model_name"],
            registry=self.registry,
        ).labels(**labels)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._success = {reason: success.labels(finished_reason=reason, **labels) for reason in FINISHED_REASONS}

    @property
    def accepting(self) -> bool:
        """Whether inference may start now: awake and not in a sleep/wake transition."""
        return not self.sleeping and self.transition is None

    def _publish(self) -> None:
        self._running_gauge.set(self.running)
        self._waiting_gauge.set(self.waiting)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a running slot (and, with kvcached, the request's KV) for the body of the ``async with``.

        The request counts as *waiting* until it holds both: like vLLM's scheduler, a request whose KV
        does not fit under the limit is not admitted to the running batch.
        """
        if not self.accepting:
            raise EngineAsleep()
        self.waiting += 1
        self._publish()
        kv = contextlib.AsyncExitStack()
        try:
            await self._slots.acquire()
            try:
                if self.kv is not None:
                    await kv.enter_async_context(self.kv.allocation())
            except BaseException:
                self._slots.release()
                raise
        finally:
            self.waiting -= 1
            self._publish()
        self.running += 1
        self._publish()
        try:
            async with kv:  # releases the KV when the request finishes
                if not self.accepting:  # fell asleep while this request was queued
                    raise EngineAsleep()
                yield
        finally:
            self.running -= 1
            self._publish()
            self._slots.release()

    def finished(self, reason: str) -> None:
        """Count one finished request under vLLM's ``finished_reason`` label."""
        self._success[reason].inc()
        if reason != "abort":
            self.success_total += 1

    async def sleep(self, level: int) -> None:
        """Go to sleep at ``level`` (1 or 2), taking ``--sim-sleep-seconds``."""
        async with self._transition_lock:
            if self.sleeping:
                self.sleep_level = max(self.sleep_level, level)
                return
            self.transition = "sleeping"
            try:
                await asyncio.sleep(self.options.sleep_seconds)
                self.sleeping = True
                self.sleep_level = level
            finally:
                self.transition = None

    async def wake_up(self) -> None:
        """Wake up, taking ``--sim-wake-seconds``; raise WakeFailed under ``--sim-fail-wake``."""
        async with self._transition_lock:
            if not self.sleeping:
                return
            self.transition = "waking"
            try:
                await asyncio.sleep(self.options.wake_seconds)
                if self.options.fail_wake:
                    raise WakeFailed("simulated wake-up failure")
                self.sleeping = False
                self.sleep_level = 0
            finally:
                self.transition = None

    def metrics_text(self) -> bytes:
        """Prometheus text exposition of this engine's registry."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, Any]:
        """The private /sim/state document."""
        return {
            "pid": os.getpid(),
            "mode": self.options.mode,
            "model": self.options.model,
            "served_model_name": self.options.served_model_name,
            "sleeping": self.sleeping,
            "level": self.sleep_level,
            "transition": self.transition,
            "running": self.running,
            "waiting": self.waiting,
            "success_total": self.success_total,
            "memory_bytes": self.options.memory_bytes,
            "max_running": self.options.max_running,
            "kv": None if self.kv is None else self.kv.snapshot(),
        }
