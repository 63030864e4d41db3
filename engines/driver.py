"""What the supervisor needs from an engine kind, whatever the kind: the driver interface.

An owner holds one driver for its engine (``vllm.VllmDriver``, ``sglang.SglangDriver``,
``ollama.OllamaDriver``). The driver builds the command line and environment, says what is
wrong with an activation, and speaks the engine's own HTTP API for readiness, sleep state,
sleep, wake, observations and LoRA adapters. It keeps no lifecycle state of its own: the owner
decides, the driver carries it out. ("Adapter" in this codebase means a LoRA adapter only.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from msgspec import Struct, field

if TYPE_CHECKING:
    from registry.record import EngineRecord


class Observation(Struct, frozen=True):
    """What an engine says about itself; None where it does not say."""

    running: int | None = None  # requests being served now
    waiting: int | None = None  # requests queued
    success_total: int | None = None  # requests finished successfully, ever (a counter)
    footprint_bytes: int | None = None  # Ollama's size_vram of the loaded model
    context_length: int | None = None  # Ollama's context_length of the loaded model
    sleep_level: int | None = None  # vLLM's vllm:engine_sleep_state: 0 awake, 1 or 2 asleep


class LaunchContext(Struct, frozen=True):
    """Everything outside the record that decides how an engine is started."""

    command: tuple[str, ...]  # the executable prefix (e.g. ("vllm", "serve"))
    simulated: bool  # the prefix runs the simulated engine
    bind_host: str
    base_env: Mapping[str, str]
    extra_env: Mapping[str, str] = field(default_factory=dict)
    model_path: str | None = None  # a local copy of the artifact to start on (the weight cache)


class EngineDriver(Protocol):
    kind: str

    def command(self, record: EngineRecord, ctx: LaunchContext) -> tuple[list[str], dict[str, str]]:
        """argv and env for the engine process."""
        ...

    def sleep_unsupported(self) -> str | None:
        """Why this engine cannot sleep (a 409 for sleep requests), or None when it can."""
        ...

    async def healthy(self, timeout_s: float, asleep: bool = False) -> bool:
        """The engine's port answers its health endpoint. ``asleep``: the agent believes the
        engine sleeps (SGLang's /health must not be asked then)."""
        ...

    async def probe(self, timeout_s: float, asleep: bool) -> tuple[bool, bool | None]:
        """One health probe of a running engine: did it answer, and its word on sleep (None:
        it does not say). Cheap: one request, bounded by ``timeout_s``."""
        ...

    async def prepare(self, timeout_s: float) -> bool:
        """After the first health answer of a started engine and before it counts as ready
        (Ollama loads its model here): True when it did something that may change the engine's
        word on sleep (which is then asked again). Raises EngineCallError."""
        ...

    async def is_sleeping(self, timeout_s: float) -> bool | None:
        """The engine's own word on sleep, or None when it does not say."""
        ...

    async def sleep(self, level: int, timeout_s: float) -> None:
        """Raises EngineCallError."""
        ...

    async def wake(self, from_level: int, timeout_s: float) -> None:
        """Wake from a sleep of ``from_level``. Raises EngineCallError."""
        ...

    async def observe(self, timeout_s: float) -> Observation | None:
        ...

    async def load_adapter(self, name: str, path: str, timeout_s: float) -> None:
        """Load a LoRA adapter at run time. Raises EngineCallError (``status`` the engine's)."""
        ...

    async def unload_adapter(self, name: str, timeout_s: float) -> None:
        """Raises EngineCallError; an engine that never had it answers 404 (vLLM) or 400."""
        ...

    async def loaded_adapters(self, timeout_s: float) -> dict[str, str] | None:
        """The adapters the engine serves now (name -> path); None when it does not say."""
        ...

    async def close(self) -> None:
        ...


def adapters_from_cards(cards: list[dict[str, object]] | None) -> dict[str, str] | None:
    """LoRA adapters among ``/v1/models`` cards: the ones with a ``parent`` (vLLM, SGLang)."""
    if cards is None:
        return None
    return {str(c["id"]): str(c.get("root") or "") for c in cards if c.get("parent")}
