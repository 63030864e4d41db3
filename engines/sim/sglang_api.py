"""HTTP application of the simulated engine in SGLang mode (``--sim-mode sglang``).

It answers as ``python -m sglang.launch_server`` does (SGLang 0.5): ``/health`` and
``/health_generate`` run a (simulated) one-token generation, so on a released engine they wait
``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds and answer 503; ``/ready``, ``/model_info`` and
``/v1/models`` do no GPU work; ``/metrics`` exists only with ``--enable-metrics``. The memory
saver's ``/release_memory_occupation`` and ``/resume_memory_occupation`` take GET or POST with a
required JSON body (``{}`` at least; ``tags`` a list), answer 200 ``null``, and bring the server
down on a release while requests are in flight or a resume of a tag that was not released
(``engines.sim.state``). The OpenAI-compatible inference routes are shared with vLLM mode, with
SGLang's paths for the rest: ``/v1/responses``, ``/v1/score``, ``/v1/rerank``, ``/v1/classify``,
``/tokenize``, ``/v1/tokenize``, ``/detokenize``, ``/v1/detokenize``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from engines.sim import logs, lora, openai_api, responses_api, scores_api, tokens_api
from engines.sim.openai_api import STATE_KEY
from engines.sim.state import EngineState

SGLANG_SIM_VERSION = "0.5.23+sim"


def _unprocessable(loc: list[Any], kind: str, msg: str) -> web.Response:
    """FastAPI's 422, as SGLang's request validation answers it."""
    return web.json_response({"detail": [{"type": kind, "loc": loc, "msg": msg, "input": None}]},
                             status=422)


async def _tags(request: web.Request) -> list[str] | None | web.Response:
    raw = await request.read()
    if not raw:
        return _unprocessable(["body"], "missing", "Field required")
    try:
        body = json.loads(raw)
    except ValueError:
        return _unprocessable(["body"], "json_invalid", "JSON decode error")
    if not isinstance(body, dict):
        return _unprocessable(["body"], "model_attributes_type", "Input should be an object")
    tags = body.get("tags")
    if tags is not None and (not isinstance(tags, list)
                             or not all(isinstance(t, str) for t in tags)):
        return _unprocessable(["body", "tags"], "list_type", "Input should be a valid list")
    return tags


async def _release(request: web.Request) -> web.Response:
    tags = await _tags(request)
    if isinstance(tags, web.Response):
        return tags
    logs.engine_log("INFO", f"release_memory_occupation tags={tags}", "scheduler.py")
    request.app[STATE_KEY].release(tags)
    return web.json_response(None)


async def _resume(request: web.Request) -> web.Response:
    tags = await _tags(request)
    if isinstance(tags, web.Response):
        return tags
    logs.engine_log("INFO", f"resume_memory_occupation tags={tags}", "scheduler.py")
    request.app[STATE_KEY].resume(tags)
    return web.json_response(None)


async def _health(request: web.Request) -> web.Response:
    state: EngineState = request.app[STATE_KEY]
    if state.sglang_released:
        # The generation /health submits waits on released memory until the health timeout.
        await asyncio.sleep(state.options.health_timeout_s)
        return web.Response(status=503)
    return web.Response(status=200)


async def _ready(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _model_info(request: web.Request) -> web.Response:
    options = request.app[STATE_KEY].options
    return web.json_response({
        "model_path": options.model, "served_model_name": options.served_model_name,
        "tokenizer_path": options.model, "is_generation": True, "weight_version": "default",
        "preferred_sampling_params": None, "model_type": "sim", "architectures": ["SimForCausalLM"]})


async def _server_info(request: web.Request) -> web.Response:
    options = request.app[STATE_KEY].options
    return web.json_response({
        "model_path": options.model, "served_model_name": options.served_model_name,
        "host": options.host, "port": options.port, "context_length": options.max_model_len,
        "enable_memory_saver": options.enable_memory_saver, "version": SGLANG_SIM_VERSION})


async def _models(request: web.Request) -> web.Response:
    options = request.app[STATE_KEY].options
    created = int(time.time())
    card = {"id": options.served_model_name, "object": "model", "created": created,
            "owned_by": "sglang", "root": options.served_model_name, "parent": None,
            "max_model_len": options.max_model_len}
    data = [card, *lora.adapter_cards(request.app[STATE_KEY], created, "sglang")]
    return web.json_response({"object": "list", "data": data})


async def _sim_state(request: web.Request) -> web.Response:
    state: EngineState = request.app[STATE_KEY]
    return web.json_response({**state.snapshot(), "released": sorted(state.sglang_released)})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE_KEY].metrics_text()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_sglang_app(state: EngineState) -> web.Application:
    app = web.Application()
    app[STATE_KEY] = state
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, _health)
    app.router.add_get("/ready", _ready)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, _model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, _server_info)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/sim/state", _sim_state)  # the simulator's own debugging document
    if state.options.enable_metrics:
        app.router.add_get("/metrics", _metrics)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/release_memory_occupation", _release)
        app.router.add_route(method, "/resume_memory_occupation", _resume)
    app.router.add_post("/load_lora_adapter", lora.sglang_load)
    app.router.add_post("/unload_lora_adapter", lora.sglang_unload)
    openai_api.add_routes(app)
    responses_api.add_routes(app)
    scores_api.add_routes(app, scores_api.sglang_paths)
    for path in ("/tokenize", "/v1/tokenize"):
        app.router.add_post(path, tokens_api.tokenize)
    return app
