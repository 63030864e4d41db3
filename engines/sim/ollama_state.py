"""Mutable state of one simulated ``ollama serve``: the loaded models, their expiry and their slots.

Ollama's scheduler loads a model on the first request that names it (``POST /api/generate
{"model": m}`` with no prompt does only that), keeps it while requests hold it, and unloads it once it
has been idle for its keep-alive: the ``keep_alive`` of the latest request, or ``OLLAMA_KEEP_ALIVE``
when that request gave none (0 = unload as soon as idle, negative = never). ``keep_alive: 0`` with no
prompt unloads at once, or when the last running request finishes. While loading, a model is already
listed by ``/api/ps`` (as Ollama's scheduler records the runner before it is ready), so "listed" never
means "ready" — only a finished load request does. Each loaded model runs at most
``OLLAMA_NUM_PARALLEL`` requests; the rest wait. Its memory is the weights (``--sim-memory-bytes``) plus a
KV slab of ``--sim-kv-bytes-per-token`` x ``OLLAMA_CONTEXT_LENGTH`` x ``OLLAMA_NUM_PARALLEL``, all on GPU.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from engines.sim import logs
from engines.sim.ollama_config import (
    FOREVER,
    OllamaSettings,
    normalize_model_name,
    valid_model_name,
)
from engines.sim.options import SimOptions

OLLAMA_SIM_VERSION = "0.0.0-sim"
GO_MAX_DURATION_S = (2**63 - 1) / 1e9  # what Ollama adds to "now" for a model kept forever
_DEFAULT_REGISTRY = "registry.ollama.ai"
_DEFAULT_NAMESPACE = "library"


def rfc3339(epoch: float, utc: bool = False) -> str:
    """A timestamp shaped like Go's ``time.Time`` JSON (local offset, or ``Z`` for UTC)."""
    moment = datetime.fromtimestamp(epoch, timezone.utc)
    if utc:
        return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")
    return moment.astimezone().isoformat(timespec="microseconds")


def far_future() -> str:
    """``expires_at`` of a model kept forever: now + Go's maximum duration (about 292 years)."""
    moment = datetime.now(timezone.utc).astimezone() + timedelta(seconds=GO_MAX_DURATION_S)
    return moment.isoformat(timespec="microseconds")


def model_digest(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


@dataclass(eq=False)
class LoadedModel:
    """One model in memory (or being loaded) and the requests holding it."""

    name: str  # normalised, as /api/ps shows it
    context_length: int
    num_parallel: int
    weights_bytes: int
    kv_bytes: int
    keep_alive_s: float
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    refs: int = 0  # requests holding the model (waiting for a slot or running)
    running: int = 0
    waiting: int = 0
    expires_at: float | None = None  # wall clock; None while held, loading or kept forever
    timer: asyncio.TimerHandle | None = None
    slots: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(self.num_parallel)

    @property
    def size(self) -> int:
        return self.weights_bytes + self.kv_bytes

    @property
    def loading(self) -> bool:
        return not self.ready.is_set()

    def expires_at_text(self) -> str:
        """``expires_at`` as /api/ps reports it; a held or loading model shows now + its keep-alive."""
        if self.expires_at is not None:
            return rfc3339(self.expires_at)
        if math.isinf(self.keep_alive_s):
            return far_future()
        return rfc3339(time.time() + self.keep_alive_s)


class OllamaState:
    """The one place that knows which models are loaded and who holds them."""

    def __init__(self, options: SimOptions) -> None:
        if options.ollama is None:
            raise ValueError("OllamaState needs --sim-mode ollama options")
        self.options = options
        self.settings: OllamaSettings = options.ollama
        self.models: dict[str, LoadedModel] = {}
        self.seen: dict[str, float] = {}  # models loaded at least once -> wall clock of first load
        self.success_total = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.memory_changed: Callable[[], None] = lambda: None  # the GPU report, written at once

    # --- the catalogue -----------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        """Whether ``name`` is installed: any valid name is, except those of ``--sim-missing-model``."""
        return valid_model_name(name) and normalize_model_name(name) not in self.options.missing_models

    def installed(self) -> dict[str, float]:
        """Models /api/tags lists: manifests under ``OLLAMA_MODELS`` plus models loaded so far."""
        found = dict(self._manifests())
        for name, when in self.seen.items():
            found.setdefault(name, when)
        return {name: when for name, when in found.items() if name not in self.options.missing_models}

    def _manifests(self) -> dict[str, float]:
        root = os.path.join(self.settings.models_dir, "manifests")
        found: dict[str, float] = {}
        for directory, _dirs, files in os.walk(root):
            parts = os.path.relpath(directory, root).split(os.sep)
            if len(parts) != 3:
                continue
            registry, namespace, model = parts
            prefix = "" if registry == _DEFAULT_REGISTRY else f"{registry}/"
            prefix += "" if (not prefix and namespace == _DEFAULT_NAMESPACE) else f"{namespace}/"
            for tag in files:
                with suppress(OSError):
                    found[f"{prefix}{model}:{tag}"] = os.stat(os.path.join(directory, tag)).st_mtime
        return found

    def details(self) -> dict[str, Any]:
        """The ``details`` object of every simulated model (a Q4 GGUF of the configured size)."""
        parameters = self.options.memory_bytes * 2  # ~4 bits per parameter
        return {
            "parent_model": "",
            "format": "gguf",
            "family": "llama",
            "families": ["llama"],
            "parameter_size": f"{parameters / 1e9:.1f}B",
            "quantization_level": "Q4_K_M",
        }

    # --- loading, holding, unloading ---------------------------------------------------------------

    def _kv_bytes(self) -> int:
        return self.options.kv_bytes_per_token * self.settings.context_length * self.settings.num_parallel

    def _start_load(self, name: str, keep_alive_s: float) -> LoadedModel:
        model = LoadedModel(name, self.settings.context_length, self.settings.num_parallel,
                            self.options.memory_bytes, self._kv_bytes(), keep_alive_s)
        self.models[name] = model
        self.memory_changed()
        logs.ollama_log("INFO", f"starting llama server for {name} (simulated)", "server.go:405")
        task = asyncio.create_task(self._load(model))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return model

    async def _load(self, model: LoadedModel) -> None:
        started = time.monotonic()
        await asyncio.sleep(self.options.load_seconds)
        model.ready.set()
        self.seen.setdefault(model.name, time.time())
        logs.ollama_log("INFO", f"llama runner started in {time.monotonic() - started:.2f} seconds",
                        "server.go:594")
        self._release(model)  # every requester may have given up while it loaded

    @asynccontextmanager
    async def use(self, name: str, keep_alive_s: float | None) -> AsyncIterator[LoadedModel]:
        """Hold ``name`` loaded for the body, loading it first if needed.

        The request's keep-alive (or ``OLLAMA_KEEP_ALIVE`` when it gave none) becomes the model's; the
        idle timer starts when the last holder lets go.
        """
        key = normalize_model_name(name)
        session = self.settings.keep_alive_s if keep_alive_s is None else keep_alive_s
        model = self.models.get(key)
        if model is None:
            model = self._start_load(key, session)
        model.keep_alive_s = session
        model.refs += 1
        self._cancel_timer(model)
        try:
            await model.ready.wait()
            yield model
        finally:
            model.refs -= 1
            self._release(model)

    @asynccontextmanager
    async def slot(self, model: LoadedModel) -> AsyncIterator[None]:
        """Run the body in one of the model's ``OLLAMA_NUM_PARALLEL`` slots, waiting for one if needed."""
        model.waiting += 1
        try:
            await model.slots.acquire()
        finally:
            model.waiting -= 1
        model.running += 1
        try:
            yield
        finally:
            model.running -= 1
            model.slots.release()

    def unload(self, name: str) -> None:
        """``keep_alive: 0`` without a prompt: unload now, or as soon as the running requests finish."""
        model = self.models.get(normalize_model_name(name))
        if model is None:
            return
        model.keep_alive_s = 0.0
        self._release(model)

    def _release(self, model: LoadedModel) -> None:
        """Start the idle clock of a model nobody holds (or unload it at once for a keep-alive of 0)."""
        if model.refs > 0 or model.loading or self.models.get(model.name) is not model:
            return
        self._cancel_timer(model)
        if model.keep_alive_s <= 0:
            self._unload(model)
        elif math.isinf(model.keep_alive_s):
            model.expires_at = None
        else:
            model.expires_at = time.time() + model.keep_alive_s
            model.timer = asyncio.get_running_loop().call_later(model.keep_alive_s, self._expire, model)

    def _cancel_timer(self, model: LoadedModel) -> None:
        if model.timer is not None:
            model.timer.cancel()
            model.timer = None
        model.expires_at = None

    def _expire(self, model: LoadedModel) -> None:
        model.timer = None
        if model.refs == 0 and self.models.get(model.name) is model:
            logs.ollama_log("DEBUG", f"timer expired, expiring to unload {model.name}", "sched.go:300")
            self._unload(model)

    def _unload(self, model: LoadedModel) -> None:
        self._cancel_timer(model)
        del self.models[model.name]
        self.memory_changed()
        logs.ollama_log("INFO", f"unloaded model {model.name} ({model.size} bytes freed, simulated)",
                        "sched.go:337")

    def finished(self) -> None:
        self.success_total += 1

    def shutdown(self) -> None:
        for model in list(self.models.values()):
            self._cancel_timer(model)
        for task in list(self._tasks):
            task.cancel()

    # --- documents ---------------------------------------------------------------------------------

    def ps(self) -> list[dict[str, Any]]:
        """``/api/ps`` entries, longest-lived first as Ollama sorts them."""
        entries = []
        for model in self.models.values():
            entries.append({
                "name": model.name,
                "model": model.name,
                "size": model.size,
                "digest": model_digest(model.name),
                "details": self.details(),
                "expires_at": model.expires_at_text(),
                "size_vram": model.size,  # fully offloaded to the GPU
                "context_length": model.context_length,
            })
        entries.sort(key=lambda entry: str(entry["expires_at"]), reverse=True)
        return entries

    def memory(self) -> dict[str, int]:
        """What this server would hold now (for the simulated GPU): all loaded models, all on GPU."""
        return {
            "weights_bytes": sum(m.weights_bytes for m in self.models.values()),
            "kv_bytes": sum(m.kv_bytes for m in self.models.values()),
            "host_bytes": 0,
        }

    def snapshot(self) -> dict[str, Any]:
        """The private /sim/state document."""
        keep_alive = None if math.isinf(self.settings.keep_alive_s) else self.settings.keep_alive_s
        loaded = []
        for model in self.models.values():
            loaded.append({
                "name": model.name,
                "loading": model.loading,
                "size": model.size,
                "size_vram": model.size,
                "weights_bytes": model.weights_bytes,
                "kv_bytes": model.kv_bytes,
                "context_length": model.context_length,
                "num_parallel": model.num_parallel,
                "refs": model.refs,
                "running": model.running,
                "waiting": model.waiting,
                "keep_alive_seconds": None if model.keep_alive_s == FOREVER else model.keep_alive_s,
                "expires_in_seconds": None if model.expires_at is None else model.expires_at - time.time(),
            })
        return {
            "pid": os.getpid(),
            "mode": "ollama",
            "version": OLLAMA_SIM_VERSION,
            "host": self.settings.host,
            "port": self.settings.port,
            "context_length": self.settings.context_length,
            "num_parallel": self.settings.num_parallel,
            "keep_alive_seconds": keep_alive,
            "models_dir": self.settings.models_dir,
            "missing_models": list(self.options.missing_models),
            "loaded": loaded,
            "running": sum(m.running for m in self.models.values()),
            "waiting": sum(m.waiting for m in self.models.values()),
            "success_total": self.success_total,
            "memory": self.memory(),
        }
