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
``vllm:engine_sleep_state`` says the level as vLLM's does (1 on ``awake``, ``weights_offloaded`` or
``discard_all``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from engines.sim import logs
from engines.sim.kvcache import KvCache
from engines.sim.options import SimOptions
from engines.sim.timing import reload_seconds, sleep_seconds, wake_seconds

FINISHED_REASONS = ("stop", "length", "abort")
MEMORY_TAGS = ("weights", "kv_cache")  # vLLM's CuMemAllocator tags
SGLANG_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES
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


def _scheduler_died(why: str) -> None:
    """SGLang's scheduler hit an uncaught error: it logs and the whole server goes down."""
    logs.engine_log("ERROR", f"Scheduler hit an exception: {why}", "scheduler.py")
    os._exit(1)


class EngineState:
    """The one place that knows whether the engine sleeps and how many requests it holds."""

    def __init__(self, options: SimOptions) -> None:
        self.options = options
        self.asleep_tags: set[str] = set()  # memory tags released by the current sleep
        self.sglang_released: set[str] = set()  # SGLang: tags its scheduler holds as released
        self.lora_adapters: dict[str, str] = {}  # runtime LoRA adapters: name -> path
        self.weights_valid = True  # False from a level-2 sleep until reload_weights
        self.sleep_level = 0  # 0 while awake, else the level of the current sleep
        self.transition: str | None = None  # "sleeping" / "waking" / "reloading" while a call runs
        self.memory_changed: Callable[[], None] = lambda: None  # the GPU report, written at once
        self.running = 0
        self.waiting = 0
        self.success_total = 0
        # Requests answered, by path: what a test or bench counts of the agent's probes and scrapes.
        self.requests_seen: dict[str, int] = {}
        self._slots = asyncio.Semaphore(options.max_running)
        self.kv: KvCache | None = None  # present when the engine runs with kvcached
        if options.kvcached_ipc_name is not None:
            self.kv = KvCache(options.kvcached_ipc_name, options.kvcached_shm_dir, options.kv_capacity_bytes,
                              options.kv_request_bytes)
            self.kv.used_changed = lambda: self.memory_changed()  # looked up late: main sets it
        self._transition_lock = asyncio.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        if options.mode == "sglang":
            self._init_sglang_metrics()
        else:
            self._init_vllm_metrics()

    def _init_vllm_metrics(self) -> None:
        labels = {"model_name": self.options.served_model_name}
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
        # vLLM's sleep gauge: 1 on the series of the state it is in (a level-1 sleep offloads the
        # weights, a level-2 sleep discards them), read at scrape time.
        sleep_state = Gauge("vllm:engine_sleep_state", "The engine's sleep state (1 on the current one).",
                            ["engine", "model_name", "sleep_state"], registry=self.registry)
        for level, name in enumerate(("awake", "weights_offloaded", "discard_all")):
            sleep_state.labels(engine="0", sleep_state=name, **labels).set_function(
                functools.partial(self._in_sleep_level, level))

    def _in_sleep_level(self, level: int) -> float:
        return float(self.sleep_level == level)

    def _init_sglang_metrics(self) -> None:
        """SGLang's names and labels (``--enable-metrics``): scheduler gauges per rank, and a
        tokenizer counter of finished requests (aborted ones too) by ``is_streaming``."""
        base = {"model_name": self.options.served_model_name, "engine_type": "unified"}
        ranks = {**base, "tp_rank": "0", "pp_rank": "0"}
        self._running_gauge = Gauge("sglang:num_running_reqs", "The number of running requests.",
                                    list(ranks), registry=self.registry).labels(**ranks)
        self._waiting_gauge = Gauge("sglang:num_queue_reqs",
                                    "The number of requests in the waiting queue.", list(ranks),
                                    registry=self.registry).labels(**ranks)
        finished = Counter("sglang:num_requests", "Number of requests processed.",
                           [*base, "is_streaming"], registry=self.registry)
        aborted = Counter("sglang:num_aborted_requests", "Number of requests aborted.",
                          list(base), registry=self.registry).labels(**base)
        done = finished.labels(is_streaming="false", **base)
        self._success = {"stop": done, "length": done, "abort": done}
        self._aborted = aborted

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
        """Count one finished request under vLLM's ``finished_reason`` label (SGLang counts
        every finished request, and aborted ones once more on their own)."""
        self._success[reason].inc()
        if reason == "abort" and self.options.mode == "sglang":
            self._aborted.inc()
        if reason != "abort":
            self.success_total += 1

    def sleep_time(self, level: int) -> float:
        """``--sim-sleep-seconds``, or what falling asleep at ``level`` takes this model."""
        given = self.options.sleep_seconds
        return sleep_seconds(self.options.memory_bytes, level) if given is None else given

    def wake_time(self, tags: set[str]) -> float:
        """``--sim-wake-seconds``, or what waking ``tags`` from the current level takes this model."""
        given = self.options.wake_seconds
        return (wake_seconds(self.options.memory_bytes, self.sleep_level, "weights" in tags)
                if given is None else given)

    def reload_time(self) -> float:
        """``--sim-reload-seconds``, or what reading this model's weights from disk takes."""
        given = self.options.reload_seconds
        return reload_seconds(self.options.memory_bytes) if given is None else given

    async def sleep(self, level: int) -> None:
        """Go to sleep at ``level`` (1 or 2), taking ``sleep_time(level)``.

        Like vLLM's executor, a sleep while any tag is still asleep changes nothing (not even the level).
        """
        async with self._transition_lock:
            if self.sleeping:
                logs.engine_log("WARNING", "Executor is already sleeping.", "abstract.py")
                return
            self.transition = "sleeping"
            try:
                await asyncio.sleep(self.sleep_time(level))
                self.asleep_tags = set(MEMORY_TAGS)
                self.sleep_level = level
                if level >= 2:
                    self.weights_valid = False  # discarded, not offloaded
                self.memory_changed()
            finally:
                self.transition = None

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake the named memory tags (all without ``tags``), taking ``wake_time()``.

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
                await asyncio.sleep(self.wake_time(wanted))
                if self.options.fail_wake:
                    raise WakeFailed("simulated wake-up failure")
                self.asleep_tags -= wanted
                if not self.asleep_tags:
                    self.sleep_level = 0
                self.memory_changed()
            finally:
                self.transition = None

    # ---- SGLang's memory saver -----------------------------------------------------------------

    def release(self, tags: Sequence[str] | None) -> None:
        """SGLang's ``release_memory_occupation``: pause the named tags (all without ``tags``).

        SGLang asserts that its scheduler is idle first; a release with requests in flight is an
        uncaught error that brings its whole server down, and so it does here."""
        if self.running or self.waiting:
            _scheduler_died("AssertionError: release_memory_occupation should be called only "
                            "when server is idle.")
        for tag in tags or SGLANG_TAGS:
            if tag not in SGLANG_TAGS:
                continue  # SGLang ignores what it does not know
            self.sglang_released.add(tag)
            if tag in MEMORY_TAGS and self.options.enable_memory_saver:
                self.asleep_tags.add(tag)
        if "weights" in self.sglang_released and self.options.enable_memory_saver:
            self.sleep_level = 1 if self.options.weights_cpu_backup else 2
        self.memory_changed()

    def resume(self, tags: Sequence[str] | None) -> None:
        """SGLang's ``resume_memory_occupation``: a tag that was not released is a KeyError in
        its scheduler, which brings the server down."""
        for tag in tags or SGLANG_TAGS:
            if tag not in self.sglang_released:
                _scheduler_died(f"KeyError: {tag!r}")
            self.sglang_released.discard(tag)
            if tag in self.asleep_tags:
                self.asleep_tags.discard(tag)
                if tag == "weights" and not self.options.weights_cpu_backup:
                    self.weights_valid = False  # the memory is back, its contents are not
        if not self.asleep_tags:
            self.sleep_level = 0
        self.memory_changed()

    async def collective_rpc(self, method: str) -> list[Any]:
        """Run ``method`` on the (one) simulated worker; return the per-worker results.

        Only ``reload_weights`` is modelled: it loads the weights in place, taking
        ``reload_time()``, and needs the weight memory mapped (awake).
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
                took = self.reload_time()
                await asyncio.sleep(took)
                self.weights_valid = True
            finally:
                self.transition = None
        logs.engine_log("INFO", f"Reloading weights inplace took {took:.6f} seconds "
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
            "lora_adapters": dict(self.lora_adapters),
            "requests_seen": dict(self.requests_seen),
        }
