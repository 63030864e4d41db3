"""vLLM's (and SGLang's) ``POST /v1/responses`` on the simulated engine: OpenAI's Responses API.

The shapes are vLLM's ``ResponsesResponse`` (``vllm/entrypoints/openai/responses/protocol.py``):
``{"id": "resp_..", "object": "response", "created_at", "model", "status": "completed",
"output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text",
"text", "annotations": []}]}], "usage": {"input_tokens", "output_tokens", "total_tokens"}}``.
``input`` is a string or a list of message items (``{"role", "content"}``, content a string or
``input_text`` parts); ``instructions`` come first; ``max_output_tokens`` bounds the answer.
With ``"stream": true`` the answer is server-sent events as vLLM sends them
(``event: response.created``, ``response.output_text.delta`` per token,
``response.completed`` with the whole response). A pooling model answers 400, as vLLM's does.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from engines.sim.openai_api import (
    DEFAULT_MAX_TOKENS,
    STATE_KEY,
    RequestError,
    check_model,
    error_response,
    read_body,
)
from engines.sim.state import EngineAsleep, EngineState, WeightsDiscarded
from engines.sim.textgen import chat_prompt, count_tokens, generate_tokens


def _prompt(body: dict[str, Any]) -> str:
    given = body.get("input")
    messages: list[Any] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for item in given:
            if isinstance(item, dict) and isinstance(item.get("content"), list):
                parts = [{"text": p.get("text", "")} for p in item["content"]
                         if isinstance(p, dict)]
                item = {**item, "content": parts}
            messages.append(item)
    else:
        raise RequestError(400, "'input' must be a string or a non-empty list of items",
                           "BadRequestError")
    try:
        return chat_prompt(messages)
    except ValueError as exc:
        raise RequestError(400, str(exc), "BadRequestError") from exc


def _document(rid: str, model: str, created: float, status: str, text: str | None,
              usage: dict[str, Any] | None, body: dict[str, Any]) -> dict[str, Any]:
    output = [] if text is None else [{
        "type": "message", "id": "msg_" + rid[5:], "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}]}]
    return {"id": rid, "object": "response", "created_at": int(created), "model": model,
            "status": status, "output": output, "usage": usage, "error": None,
            "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0), "background": False, "text": {"format":
                                                                          {"type": "text"}},
            "truncation": "disabled", "metadata": None, "previous_response_id": None,
            "reasoning": None, "service_tier": "auto", "store": False, "user": None}


def _event(kind: str, doc: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **doc}).encode() \
        + b"\n\n"


async def _responses(request: web.Request) -> web.StreamResponse:
    state: EngineState = request.app[STATE_KEY]
    if state.options.runner == "pooling":
        return error_response(400, "The model does not support Responses API",
                              "BadRequestError")
    try:
        body = await read_body(request)
        check_model(body, state)
        prompt = _prompt(body)
        limit = body.get("max_output_tokens") or DEFAULT_MAX_TOKENS
        if not isinstance(limit, int) or limit < 1:
            raise RequestError(400, "max_output_tokens must be an integer of at least 1",
                               "BadRequestError")
    except RequestError as exc:
        return exc.response
    rid, created, model = "resp_" + uuid.uuid4().hex, time.time(), state.options.served_model_name
    tokens = generate_tokens(prompt, limit)
    usage = {"input_tokens": count_tokens(prompt), "output_tokens": limit,
             "total_tokens": count_tokens(prompt) + limit,
             "input_tokens_details": {"cached_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": 0}}
    done = _document(rid, model, created, "completed", "".join(tokens), usage, body)
    try:
        async with state.slot():
            if state.options.request_seconds:
                await asyncio.sleep(state.options.request_seconds)
            if body.get("stream") is not True:
                state.finished("stop")
                return web.json_response(done)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            started = _document(rid, model, created, "in_progress", None, None, body)
            await out.write(_event("response.created", {"response": started,
                                                        "sequence_number": 0}))
            for n, token in enumerate(tokens, 1):
                if n > 1 and state.options.token_seconds:
                    await asyncio.sleep(state.options.token_seconds)
                await out.write(_event("response.output_text.delta", {
                    "item_id": "msg_" + rid[5:], "output_index": 0, "content_index": 0,
                    "delta": token, "logprobs": [], "sequence_number": n}))
            await out.write(_event("response.completed", {"response": done,
                                                          "sequence_number": limit + 1}))
            await out.write_eof()
            state.finished("stop")
            return out
    except EngineAsleep:
        return error_response(503, "The engine is sleeping; wake it up first.",
                              "ServiceUnavailableError")
    except WeightsDiscarded as exc:
        return error_response(500, str(exc), "InternalServerError")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", _responses)
