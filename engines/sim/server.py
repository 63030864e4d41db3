"""HTTP application of the simulated engine: vLLM's control, sleep-mode and metrics endpoints.

The agent supervises engines only through HTTP: readiness via ``/health``, the served name via
``/v1/models``, idleness via ``/metrics`` and sleep mode via ``/sleep``, ``/wake_up`` and
``/is_sleeping`` (present only with ``VLLM_SERVER_DEV_MODE=1`` and ``--enable-sleep-mode``, as in
vLLM). ``/wake_up`` takes vLLM's repeatable ``tags`` query parameter (``weights``, ``kv_cache``; none =
all), and ``/collective_rpc`` (dev mode only) runs ``reload_weights``, the step that brings a level-2
sleeper back: ``wake_up?tags=weights``, ``collective_rpc {"method": "reload_weights"}``,
``wake_up?tags=kv_cache``. This module wires those endpoints, plus the inference endpoints from
``openai_api``, ``/tokenize`` and ``/v1/embeddings`` from ``tokens_api``, ``/v1/responses``
(``responses_api``), score, rerank, pooling, classify and ``/detokenize`` (``scores_api``) and a private ``/sim/state``
debugging document, onto one aiohttp application.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from engines.sim import logs, lora, openai_api, responses_api, scores_api, tokens_api
from engines.sim.openai_api import STATE_KEY, error_response
from engines.sim.state import EngineState, RpcFailed, WakeFailed

SIM_VERSION = "0.0.0+sim"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def dev_mode_enabled(value: str | None) -> bool:
    """vLLM reads ``VLLM_SERVER_DEV_MODE`` as ``bool(int(value))``; anything unparsable is off."""
    try:
        return bool(int(value or "0"))
    except ValueError:
        return False


def _make_access_log_middleware(enabled: bool, quiet_paths: tuple[str, ...] = (),
                                 quiet_prefixes: tuple[str, ...] = ()) -> Any:
    """uvicorn's access log, less the paths the engine was told to leave out (vLLM: exact
    paths, SGLang: prefixes); every request, logged or not, is counted by path
    (``requests_seen`` in /sim/state)."""
    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        seen = request.app[STATE_KEY].requests_seen
        seen[request.path] = seen.get(request.path, 0) + 1
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            # FastAPI (vLLM's framework) answers unknown routes with a JSON "detail" document.
            response = web.json_response({"detail": exc.reason}, status=exc.status)
            if exc.status == 405:
                response.headers["Allow"] = exc.headers.get("Allow", "")
        if enabled and request.path not in quiet_paths and not request.path.startswith(
                quiet_prefixes or ("\0",)):
            peer = request.remote or "-"
            transport = request.transport
            if transport is not None:
                peername = transport.get_extra_info("peername")
                if isinstance(peername, tuple) and len(peername) >= 2:
                    peer = f"{peername[0]}:{peername[1]}"
            logs.access_log(peer, request.method, request.path_qs, response.status, response.reason)
        return response

    return middleware


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": SIM_VERSION})


async def _models(request: web.Request) -> web.Response:
    options = request.app[STATE_KEY].options
    created = int(time.time())
    data: list[dict[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": options.model,
            "parent": None,
            "max_model_len": options.max_model_len,
            "permission": [],
        }
        for name in options.served_model_names
    ]
    data += lora.adapter_cards(request.app[STATE_KEY], created, "vllm")
    return web.json_response({"object": "list", "data": data})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE_KEY].metrics_text()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _sim_state(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE_KEY].snapshot())


async def _sleep(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    raw_level = request.query.get("level", "1")
    try:
        level = int(raw_level)
    except ValueError:
        level = 0
    if level not in (1, 2):
        return error_response(400, f"Invalid sleep level {raw_level!r}; use 1 or 2.", "BadRequestError")
    logs.engine_log("INFO", f"Putting the engine to sleep (level {level}).", "api_server.py")
    took = state.sleep_time(level)
    await state.sleep(level)
    logs.engine_log("INFO", f"It took {took:.6f} seconds to fall asleep.", "gpu_worker.py")
    return web.Response(status=200)


async def _wake_up(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    tags = request.query.getall("tags", [])  # vLLM: no tags means every tag
    logs.engine_log("INFO", f"wake up the engine with tags: {tags or None}", "api_server.py")
    try:
        await state.wake_up(tags or None)
    except WakeFailed as exc:
        logs.engine_log("ERROR", f"Wake-up failed: {exc}", "api_server.py")
        return error_response(500, f"Wake-up failed: {exc}", "InternalServerError")
    return web.Response(status=200)


async def _is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": request.app[STATE_KEY].sleeping})


async def _collective_rpc(request: web.Request) -> web.Response:
    """vLLM's dev-mode RPC: ``{"method": NAME, "args": [...], "kwargs": {...}, "timeout": s}``."""
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return web.json_response({"detail": f"JSON decode error: {exc}"}, status=400)
    method = body.get("method") if isinstance(body, dict) else None
    if method is None:
        return web.json_response({"detail": "Missing 'method' in request body"}, status=400)
    logs.engine_log("INFO", f"collective_rpc {method!r}", "api_server.py")
    try:
        results = await request.app[STATE_KEY].collective_rpc(str(method))
    except RpcFailed as exc:
        logs.engine_log("ERROR", f"collective_rpc {method!r} failed: {exc}", "api_server.py")
        return error_response(500, str(exc), "InternalServerError")
    return web.json_response({"results": results})


def build_app(state: EngineState, dev_mode: bool) -> web.Application:
    """The complete application; sleep endpoints exist only with dev mode and ``--enable-sleep-mode``."""
    o = state.options
    app = web.Application(middlewares=[_make_access_log_middleware(o.access_log, o.quiet_paths,
                                                                   o.quiet_prefixes)])
    app[STATE_KEY] = state
    app.router.add_get("/health", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/sim/state", _sim_state)
    openai_api.add_routes(app)
    tokens_api.add_routes(app)
    responses_api.add_routes(app)
    scores_api.add_routes(app, scores_api.vllm_paths)
    if dev_mode:
        app.router.add_post("/collective_rpc", _collective_rpc)
    if lora.runtime_updates_allowed(os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")):
        app.router.add_post("/v1/load_lora_adapter", lora.vllm_load)
        app.router.add_post("/v1/unload_lora_adapter", lora.vllm_unload)
    if dev_mode and state.options.enable_sleep_mode:
        app.router.add_post("/sleep", _sleep)
        app.router.add_post("/wake_up", _wake_up)
        app.router.add_get("/is_sleeping", _is_sleeping)
    return app
