"""The Ollama engine kind: one ``ollama serve`` per model on its own port, driven by its API.

Activate = start the server, then load the model (``/api/generate`` with no prompt); it is
ready when ``/api/ps`` lists the model. Sleep = unload (``keep_alive: 0``): the GPU memory is
freed but the server stays; wake = load again. The server runs with ``OLLAMA_KEEP_ALIVE=-1``,
so a model stays loaded until the agent decides otherwise. ``/api/ps`` gives the observed
footprint (``size_vram``) and context length, which the snapshot reports as facts.
Calls go through the official ``ollama`` client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

import httpx
import ollama

from contract.engines import OLLAMA_ARG_ENV as ARG_ENV
from contract.engines import ollama_tag as model_tag
from engine_http.upstream import Upstream
from engines.driver import LaunchContext, Observation
from engines.client import EngineCallError, EngineClient

if TYPE_CHECKING:
    from registry.record import EngineRecord

T = TypeVar("T")


def _loaded(names: list[str], model: str) -> bool:
    full = model if ":" in model else model + ":latest"
    return any(name in (model, full) for name in names)


class OllamaDriver:
    kind = "ollama"

    def __init__(self, http: Upstream, host: str, port: int, model: str) -> None:
        self._model = model_tag(model)
        self._http = EngineClient(http, host, port)
        self._client = ollama.AsyncClient(host=f"http://{host}:{port}")

    def command(self, record: EngineRecord, ctx: LaunchContext) -> tuple[list[str], dict[str, str]]:
        spec = record.spec
        argv = [*ctx.command]
        if ctx.simulated:
            argv += [self._model, "--sim-mode", "ollama"]
            for key, value in spec.args.items():
                if key.startswith("--sim-"):
                    argv += [key] + ([value] if value != "" else [])
        env = dict(ctx.base_env)
        env.update(ctx.extra_env)
        env["OLLAMA_HOST"] = f"{ctx.bind_host}:{record.port}"
        env["OLLAMA_KEEP_ALIVE"] = "-1"  # loaded until the agent unloads it
        for key, value in spec.args.items():
            if key in ARG_ENV:
                env[ARG_ENV[key]] = value
        return argv, env

    def sleep_unsupported(self) -> str | None:
        return None

    async def healthy(self, timeout_s: float, asleep: bool = False) -> bool:
        return await self._http.health(timeout_s, "/")  # "Ollama is running"

    async def probe(self, timeout_s: float, asleep: bool) -> tuple[bool, bool | None]:
        found = await self._names(timeout_s)
        return (False, None) if found is None else (True, not _loaded(found[0], self._model))

    async def prepare(self, timeout_s: float) -> bool:
        await self._load(timeout_s)
        return True

    async def _load(self, timeout_s: float) -> None:
        await self._call(self._client.generate(model=self._model, keep_alive=-1), timeout_s,
                         "load")

    async def _names(self, timeout_s: float) -> tuple[list[str], ollama.ProcessResponse] | None:
        try:
            ps = await self._call(self._client.ps(), timeout_s, "ps")
        except EngineCallError:
            return None
        return [m.model or "" for m in ps.models], ps

    async def is_sleeping(self, timeout_s: float) -> bool | None:
        found = await self._names(timeout_s)
        return None if found is None else not _loaded(found[0], self._model)

    async def sleep(self, level: int, timeout_s: float) -> None:
        await self._call(self._client.generate(model=self._model, keep_alive=0), timeout_s,
                         "unload")

    async def wake(self, from_level: int, timeout_s: float) -> None:
        await self._load(timeout_s)

    async def observe(self, timeout_s: float) -> Observation | None:
        found = await self._names(timeout_s)
        if found is None:
            return None
        for m in found[1].models:
            if _loaded([m.model or ""], self._model):
                ctx = getattr(m, "context_length", None)
                return Observation(footprint_bytes=m.size_vram,
                                   context_length=int(ctx) if ctx else None)
        return Observation()

    async def _call(self, coro: Awaitable[T], timeout_s: float, what: str) -> T:
        try:
            return await asyncio.wait_for(coro, timeout_s)
        except TimeoutError as exc:
            raise EngineCallError(f"Ollama {what} got no answer within {timeout_s:g} s") from exc
        except ollama.ResponseError as exc:
            raise EngineCallError(f"Ollama {what} answered {exc.status_code}: {exc.error}") from exc
        except (httpx.HTTPError, OSError) as exc:
            raise EngineCallError(f"Ollama {what} failed: {exc}") from exc

    async def load_adapter(self, name: str, path: str, timeout_s: float) -> None:
        raise EngineCallError("Ollama takes no LoRA adapter at run time; build a model with "
                              "an ADAPTER line in its Modelfile instead", 400)

    async def unload_adapter(self, name: str, timeout_s: float) -> None:
        raise EngineCallError("Ollama takes no LoRA adapter at run time", 400)

    async def loaded_adapters(self, timeout_s: float) -> dict[str, str] | None:
        return None

    async def close(self) -> None:
        await self._client.close()  # type: ignore[no-untyped-call]
