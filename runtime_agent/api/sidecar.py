"""The AIBrix runtime sidecar's other routes: readiness, the served models, LoRA adapters.

``GET /ready`` answers 200 once the registry was read and every engine the previous agent left
was re-adopted (or found gone); ``GET /v1/models`` lists every served model and adapter across
this agent's engines in OpenAI's format; ``POST /v1/lora_adapter/load`` and ``/unload`` take the
sidecar's bodies (direct: ``lora_name`` + ``lora_path``; delegated: ``lora_name`` +
``artifact_url``), plus an optional ``model_name`` to pick the engine, since this agent runs many.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web
from contract.engines import HF_SCHEMES
from contract.phases import Phase
from guard.paths import FILE_SCHEME, Refused, is_hub_repo_id, judge_local_path
from runtime_agent.api.context import AGENT_KEY
from runtime_agent.api.errors import BadRequest, parse_as
from runtime_agent.api.replies import reply
from runtime_agent.supervision.messages import LoadAdapter, UnloadAdapter

_SERVING = (Phase.ACTIVE, Phase.SLEEPING, Phase.BOOTING)


async def ready(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    why = agent.not_ready_reason()
    if why is not None:
        return web.json_response({"status": "not ready", "reason": why}, status=503)
    return web.json_response({"status": "ready"})


async def served_models(request: web.Request) -> web.Response:
    """OpenAI's ``GET /v1/models``: each engine's model and its LoRA adapters (``parent``)."""
    data: list[dict[str, Any]] = []
    for view in sorted(request.app[AGENT_KEY].pool.views(), key=lambda v: v.spec.model_name):
        if view.phase not in _SERVING:
            continue
        created = int(view.created_at)
        data.append({"id": view.spec.model_name, "object": "model", "created": created,
                     "owned_by": view.spec.engine, "root": view.spec.artifact_url,
                     "parent": None, "max_model_len": view.context_length,
                     "ready": view.ready, "phase": view.phase.value})
        data += [{"id": name, "object": "model", "created": created,
                  "owned_by": view.spec.engine, "root": path, "parent": view.spec.model_name,
                  "max_model_len": None, "ready": view.ready and loaded,
                  "phase": view.phase.value}
                 for name, path, loaded in view.adapters]
    return web.json_response({"object": "list", "data": data})


def adapter_path(url: str) -> str:
    """What the engine is told to load for an adapter named by URL: a Hub repo id, or the
    ``file://`` URL itself (judged as a local path by ``engine_path``)."""
    for scheme in HF_SCHEMES:
        if url.startswith(scheme):
            repo = url[len(scheme):]
            if not is_hub_repo_id(repo):
                raise BadRequest(f"{url!r} does not name a Hub repository; write "
                                 f"{scheme}ORG/NAME")
            return repo
    if url.startswith(FILE_SCHEME):
        return url
    scheme = url.split("://", 1)[0] if "://" in url else "a local path"
    raise BadRequest(f"artifact_url scheme {scheme!r} is not supported for adapters; use "
                     "hf://org/name, huggingface://org/name or file:///path")


def engine_path(spelled: str, roots: tuple[Path, ...]) -> str:
    """The ``lora_path`` the engine gets: a Hugging Face repo id as it is, anything else only
    when the guard's local-path rule allows it (``guard.paths``: every spelling outside the
    roots, ``~``, relative, ``file://``, links out, is the same 403). A path inside the roots
    that does not exist goes on: the engine says so ("No adapter found"), as vLLM does.
    Blocking (it resolves symlinks): call in a thread."""
    if is_hub_repo_id(spelled):
        return spelled
    verdict = judge_local_path(spelled, roots)
    if isinstance(verdict, Refused) and verdict.status == 403:
        raise BadRequest(verdict.message, 403)
    return spelled.removeprefix(FILE_SCHEME)


async def load_adapter(request: web.Request) -> web.Response:
    from runtime_agent.api import models  # its models load with the first body (issue 26)

    req = await parse_as(request, models.LOAD_ADAPTER)
    roots = request.app[AGENT_KEY].settings.artifact_local_roots
    if isinstance(req, models.LoadLoraAdapterRuntimeRequest):
        path = await asyncio.to_thread(engine_path, adapter_path(req.artifact_url), roots)
        intent = LoadAdapter(req.lora_name, path, req.artifact_url)
    else:
        intent = LoadAdapter(req.lora_name, await asyncio.to_thread(engine_path, req.lora_path,
                                                                    roots))
    return reply(await request.app[AGENT_KEY].pool.load_adapter(req.model_name, intent))


async def unload_adapter(request: web.Request) -> web.Response:
    from runtime_agent.api import models  # its models load with the first body (issue 26)

    req = await parse_as(request, models.UNLOAD_ADAPTER)
    return reply(await request.app[AGENT_KEY].pool.unload_adapter(
        req.model_name, UnloadAdapter(req.lora_name)))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/ready", ready)
    app.router.add_get("/v1/models", served_models)
    app.router.add_post("/v1/lora_adapter/load", load_adapter)
    app.router.add_post("/v1/lora_adapter/unload", unload_adapter)
