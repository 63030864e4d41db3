"""Mutable state of one simulated engine: request slots, sleep state and its Prometheus metrics.

vLLM's scheduler runs at most ``max_num_seqs`` requests at once and queues the rest; supervisors judge
idleness from ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``. This module keeps those
counts honest (a request is *waiting* until it holds a slot, *running* while it does) and owns the
sleep/wake state, so the HTTP layer stays a thin translation of requests into these calls.

Sleep follows vLLM's executor: a sleep releases both memory tags (``weights``, ``kv_cache``) and is a
no-op while any tag is still asleep; ``wake_up(tags)`` restores the named tags (all without tags) and
is a no-op when a named tag is not asleep; the engine sleeps until every tag is awake again. A level-1
sleep keeps the weights in host memory, a level-2 sleep *discards* them: waking the ``weights`` tag
only maps empty memory, and ``reload_weights`` (``POST /collective_rpc``) must load them in place
before the engine can serve again. An engine woken without that reload answers inference with HTTP 500
(a real engine would silently produce garbage), so a supervisor that skips the reload is caught.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from engines.sim import logs
from engines.sim.kvcache import KvCache
from engines.sim.options import SimOptions

FINISHED_REASONS = ("stop", "length", "abort")
MEMORY_TAGS = ("weights", "kv_cache")  # vLLM's CuMemAllocator tags
WEIGHTS_DISCARDED_MESSAGE = ("The model weights were discarded by a level-2 sleep and never reloaded: after "
                             "POST /wake_up?tags=weights, call POST /collective_rpc {\"method\": "
                             "\"reload_weights\"} before POST /wake_up?tags=kv_cache.")


class EngineAsleep(Exception):
    """Inference was attempted while the engine sleeps (or is going to sleep or waking)."""


class WakeFailed(Exception):
    """The simulated wake-up failed (``--sim-fail-wake``); the engine is still asleep."""


class WeightsDiscarded(Exception):
    """Inference on an awake engine whose weights a level-2 sleep discarded and nobody reloaded."""


class RpcFailed(Exception):
    """A ``/collective_rpc`` call the simulated workers cannot carry out."""


class EngineState:
    """The one place that knows whether the engine sleeps and how many requests it holds."""

    def __init__(self, options: SimOptions) -> None:
        self.options = options
        self.asleep_tags: set[str] = set()  # memory tags released by the current sleep
        self.weights_valid = True  # False from a level-2 sleep until reload_weights
        self.sleep_level = 0  # 0 while awake, else the level of the current sleep
        self.transition: str | None = None  # "sleeping" / "waking" / "reloading" while a call runs
        self.memory_changed: Callable[[], None] = lambda: None  # the GPU report, written at once
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
    def sleeping(self) -> bool:
        """What ``/is_sleeping`` reports: true until every memory tag is awake again."""
        return bool(self.asleep_tags)

    @property
    def accepting(self) -> bool:
        """Whether inference may start now: awake and not in a sleep/wake transition."""
        return not self.sleeping and self.transition is None

    def _check_servable(self) -> None:
        if not self.accepting:
            raise EngineAsleep()
        if not self.weights_valid:
            raise WeightsDiscarded(WEIGHTS_DISCARDED_MESSAGE)

    def _publish(self) -> None:
        self._running_gauge.set(self.running)
        self._waiting_gauge.set(self.waiting)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a running slot (and, with kvcached, the request's KV) for the body of the ``async with``.

        The request counts as *waiting* until it holds both: like vLLM's scheduler, a request whose KV
        does not fit under the limit is not admitted to the running batch.
        """
        self._check_servable()
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
                self._check_servable()  # it may have fallen asleep while this request was queued
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
        """Go to sleep at ``level`` (1 or 2), taking ``--sim-sleep-seconds``.

        Like vLLM's executor, a sleep while any tag is still asleep changes nothing (not even the level).
        """
        async with self._transition_lock:
            if self.sleeping:
                logs.engine_log("WARNING", "Executor is already sleeping.", "abstract.py")
                return
            self.transition = "sleeping"
            try:
                await asyncio.sleep(self.options.sleep_seconds)
                self.asleep_tags = set(MEMORY_TAGS)
                self.sleep_level = level
                if level >= 2:
                    self.weights_valid = False  # discarded, not offloaded
                self.memory_changed()
            finally:
                self.transition = None

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake the named memory tags (all without ``tags``), taking ``--sim-wake-seconds``.

        Raise WakeFailed under ``--sim-fail-wake``. As in vLLM, naming a tag that is not asleep makes
        the whole call a no-op, and the engine stays asleep until every tag is awake.
        """
        async with self._transition_lock:
            if not self.sleeping:
                logs.engine_log("WARNING", "Executor is not sleeping.", "abstract.py")
                return
            wanted = set(tags) if tags else set(self.asleep_tags)
            stray = sorted(wanted - self.asleep_tags)
            if stray:
                logs.engine_log("WARNING", f"Tag {stray[0]} is not in sleeping tags {sorted(self.asleep_tags)}",
                                "abstract.py")
                return
            self.transition = "waking"
            try:
                await asyncio.sleep(self.options.wake_seconds)
                if self.options.fail_wake:
                    raise WakeFailed("simulated wake-up failure")
                self.asleep_tags -= wanted
                if not self.asleep_tags:
                    self.sleep_level = 0
                self.memory_changed()
            finally:
                self.transition = None

    async def collective_rpc(self, method: str) -> list[Any]:
        """Run ``method`` on the (one) simulated worker; return the per-worker results.

        Only ``reload_weights`` is modelled: it loads the weights in place, taking
        ``--sim-reload-seconds``, and needs the weight memory mapped (awake).
        """
        if method != "reload_weights":
            raise RpcFailed(f"'Worker' object has no attribute {method!r} (the simulator models only "
                            "'reload_weights')")
        async with self._transition_lock:
            if "weights" in self.asleep_tags:
                raise RpcFailed("cannot reload weights: the weight memory is not allocated (the engine sleeps); "
                                "POST /wake_up?tags=weights first")
            self.transition = "reloading"
            try:
                await asyncio.sleep(self.options.reload_seconds)
                self.weights_valid = True
            finally:
                self.transition = None
        logs.engine_log("INFO", f"Reloading weights inplace took {self.options.reload_seconds:.6f} seconds "
                        "(simulated).", "gpu_model_runner.py")
        return [None]

    def memory(self) -> dict[str, int]:
        """What this engine would hold now: GPU weights and KV, and weights offloaded to host memory."""
        weights_awake = "weights" not in self.asleep_tags
        if "kv_cache" in self.asleep_tags:
            kv_bytes = 0
        elif self.kv is not None:
            kv_bytes = self.kv.used
        else:
            kv_bytes = self.options.kv_capacity_bytes
        offloaded = not weights_awake and self.sleep_level == 1
        return {
            "weights_bytes": self.options.memory_bytes if weights_awake else 0,
            "kv_bytes": kv_bytes,
            "host_bytes": self.options.memory_bytes if offloaded else 0,
        }

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
            "awake": {tag: tag not in self.asleep_tags for tag in MEMORY_TAGS},
            "weights_valid": self.weights_valid,
            "memory": self.memory(),
            "transition": self.transition,
            "running": self.running,
            "waiting": self.waiting,
            "success_total": self.success_total,
            "memory_bytes": self.options.memory_bytes,
            "max_running": self.options.max_running,
            "kv": None if self.kv is None else self.kv.snapshot(),
        }
