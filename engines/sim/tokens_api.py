"""vLLM's ``/tokenize`` and ``/v1/embeddings`` on the simulated engine.

A gateway refuses over-long prompts before they reach an engine by asking the engine's own
tokenizer: vLLM's ``POST /tokenize`` takes a completion-style ``{"prompt"}`` or a chat-style
``{"messages"}`` (rendered with the chat template, ``add_generation_prompt`` by default) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``. Tokenizing needs no model weights, so it
answers while the engine sleeps. ``/v1/embeddings`` exists for pooling models (``--runner pooling``,
or the older ``--task embed``); a generative model answers it with vLLM's 400 "The model does not
support Embeddings API", and a pooling model answers completions the same way. Inputs are a string,
a list of strings, or token ids; ``encoding_format: "base64"`` packs little-endian float32 as vLLM
does. An input over ``--max-model-len`` tokens is refused with vLLM's message.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any

from aiohttp import web

from engines.sim.openai_api import (
    STATE_KEY,
    RequestError,
    check_model,
    error_response,
    read_body,
)
from engines.sim.state import EngineAsleep, EngineState, WeightsDiscarded
from engines.sim.textgen import chat_prompt, embedding, token_ids


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    try:
        body = await read_body(request)
        check_model(body, state)
        text = _tokenize_text(body)
    except RequestError as exc:
        return exc.response
    ids = token_ids(text)
    strs = text.split() if body.get("return_token_strs") else None
    return web.json_response({"count": len(ids), "max_model_len": state.options.max_model_len,
                              "tokens": ids, "token_strs": strs})


def _tokenize_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise RequestError(400, "'messages' must be a list", "BadRequestError")
        try:
            return chat_prompt(messages)
        except ValueError as exc:
            raise RequestError(400, str(exc), "BadRequestError") from exc
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise RequestError(400, "'prompt' must be a string (or give 'messages')", "BadRequestError")
    return prompt


def _inputs(body: dict[str, Any]) -> list[tuple[str, int]]:
    """Each input as (text, tokens); token-id inputs count their ids."""
    if "messages" in body:
        return [(text, len(token_ids(text))) for text in [_tokenize_text(body)]]
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "'input' must be a string, a list of strings or token ids",
                           "BadRequestError")
    if all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        return [(" ".join(str(i) for i in raw), len(raw))]
    out = []
    for item in raw:
        if isinstance(item, str):
            out.append((item, len(token_ids(item))))
        elif isinstance(item, list) and all(isinstance(i, int) for i in item):
            out.append((" ".join(str(i) for i in item), len(item)))
        else:
            raise RequestError(400, "'input' must be a string, a list of strings or token ids",
                               "BadRequestError")
    return out


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def _embeddings(request: web.Request) -> web.Response:
    state: EngineState = request.app[STATE_KEY]
    options = state.options
    if options.runner != "pooling":
        return error_response(400, "The model does not support Embeddings API", "BadRequestError")
    try:
        body = await read_body(request)
        check_model(body, state)
        inputs = _inputs(body)
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise RequestError(400, f"encoding_format must be 'float' or 'base64', got {encoding!r}",
                               "BadRequestError")
        for _, tokens in inputs:
            if tokens > options.max_model_len:
                raise RequestError(
                    400, f"This model's maximum context length is {options.max_model_len} tokens. "
                    f"However, you requested {tokens} tokens in the input for embedding generation. "
                    "Please reduce the length of the input.", "BadRequestError")
    except RequestError as exc:
        return exc.response
    try:
        async with state.slot():
            if options.request_seconds:
                await asyncio.sleep(options.request_seconds)
            data = [{"index": i, "object": "embedding",
                     "embedding": _encode(embedding(text, options.embedding_dim), encoding)}
                    for i, (text, _) in enumerate(inputs)]
        state.finished("stop")
    except EngineAsleep:
        return error_response(503, "The engine is sleeping; wake it up first.", "ServiceUnavailableError")
    except WeightsDiscarded as exc:
        return error_response(500, str(exc), "InternalServerError")
    prompt_tokens = sum(tokens for _, tokens in inputs)
    return web.json_response({
        "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": options.served_model_name, "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                  "completion_tokens": 0, "prompt_tokens_details": None},
    })


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/embeddings", _embeddings)
