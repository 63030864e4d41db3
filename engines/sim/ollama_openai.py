"""Ollama's OpenAI-compatible endpoints on the simulated ``ollama serve``.

Real Ollama serves ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` and
``/v1/models`` by translating each request into its native API (``/api/chat``, ``/api/generate``,
``/api/embed``, ``/api/tags``) and the answer back (``middleware/openai.go``, ``openai/openai.go``):
ids ``chatcmpl-N`` / ``cmpl-N`` (N below 1000), ``system_fingerprint: "fp_ollama"``, ``max_tokens``
as ``num_predict`` (finish reason ``length`` when it ends the answer, else ``stop``), streams as
Server-Sent Events (``data: {chunk}``; a usage chunk with no choices when
``stream_options.include_usage``; then ``data: [DONE]``), embeddings as ``{"object": "list",
"data": [{"object": "embedding", "embedding", "index"}], "model", "usage"}``. Errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with type ``invalid_request_error`` (400),
``not_found_error`` (404) or ``api_error``. Like Ollama, a request loads its model if it is not
loaded: a gateway must not send requests to a model the agent has put to sleep.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from aiohttp import web

from engines.sim.ollama_api import (
    DEFAULT_NUM_PREDICT,
    OLLAMA_STATE_KEY,
    ApiError,
    Generation,
    model_name,
    read_body,
)
from engines.sim.ollama_config import normalize_model_name
from engines.sim.ollama_state import OllamaState
from engines.sim.textgen import chat_prompt, count_tokens, embedding

FINGERPRINT = "fp_ollama"
EMBEDDING_DIM = 768


def openai_error(status: int, message: str) -> web.Response:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                        "code": None}}, status=status)


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_tokens")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, "json: cannot unmarshal max_tokens into Go struct field of type int")
    return value if value > 0 else None


def _prompt(kind: str, body: dict[str, Any]) -> str:
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "[] is too short - 'messages'")
        try:
            return chat_prompt(messages)
        except ValueError as exc:
            raise ApiError(400, "invalid message format") from exc
    prompt = body.get("prompt")
    if not isinstance(prompt, str):  # Ollama takes one string prompt only
        raise ApiError(400, "json: cannot unmarshal prompt into Go struct field of type string")
    return prompt


class _Answer:
    """The OpenAI documents of one generation."""

    def __init__(self, kind: str, name: str, out: Generation) -> None:
        self.kind = kind
        self.out = out
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.base = {"id": f"{prefix}-{random.randrange(999)}", "created": int(time.time()),
                     "model": name, "system_fingerprint": FINGERPRINT}

    def usage(self) -> dict[str, int]:
        prompt = count_tokens(self.out.prompt)
        done = len(self.out.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def full(self) -> dict[str, Any]:
        text = "".join(self.out.tokens)
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": self.out.done_reason}
            obj = "chat.completion"
        else:
            choice = {"text": text, "index": 0, "finish_reason": self.out.done_reason}
            obj = "text_completion"
        return {**self.base, "object": obj, "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str, finish: str | None, include_usage: bool) -> bytes:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": text},
                                      "finish_reason": finish}
            doc: dict[str, Any] = {**self.base, "object": "chat.completion.chunk",
                                   "choices": [choice]}
        else:
            doc = {**self.base, "object": "text_completion",
                   "choices": [{"text": text, "index": 0, "finish_reason": finish}]}
            if include_usage:  # Ollama puts a zero usage on every completion chunk
                doc["usage"] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        return b"data: " + json.dumps(doc).encode() + b"\n\n"

    def usage_chunk(self) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        doc = {**self.base, "object": obj, "choices": [], "usage": self.usage()}
        return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def _stream(request: web.Request, answer: _Answer, token_seconds: float,
                  include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    try:
        for index, token in enumerate(answer.out.tokens):
            if index and token_seconds:
                await asyncio.sleep(token_seconds)
            await response.write(answer.chunk(token, None, include_usage))
        await response.write(answer.chunk("", answer.out.done_reason, include_usage))
        if include_usage:
            await response.write(answer.usage_chunk())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client went away; Ollama cancels the completion
        pass
    return response


async def _complete(request: web.Request, kind: str) -> web.StreamResponse:
    state: OllamaState = request.app[OLLAMA_STATE_KEY]
    try:
        body = await read_body(request)
        prompt = _prompt(kind, body)
        limit = _max_tokens(body)
        name = model_name(body, state)
    except ApiError as exc:
        return openai_error(exc.status, exc.message)
    out = Generation("chat" if kind == "chat" else "generate", name, prompt,
                     limit or DEFAULT_NUM_PREDICT, "length" if limit else "stop")
    answer = _Answer(kind, name, out)
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    async with state.use(name, None) as model, state.slot(model):
        if state.options.request_seconds:
            await asyncio.sleep(state.options.request_seconds)
        if body.get("stream") is True:
            response = await _stream(request, answer, state.options.token_seconds, include_usage)
        else:
            if state.options.token_seconds:
                await asyncio.sleep(state.options.token_seconds * max(0, len(out.tokens) - 1))
            response = web.json_response(answer.full())
        state.finished()
    return response


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "completion")


async def _embeddings(request: web.Request) -> web.Response:
    state: OllamaState = request.app[OLLAMA_STATE_KEY]
    try:
        body = await read_body(request)
        raw = body.get("input")
        if raw == "":
            raw = [""]
        if raw is None or (isinstance(raw, list) and not raw):
            raise ApiError(400, "invalid input")
        texts = [raw] if isinstance(raw, str) else [str(item) for item in raw]
        fmt = body.get("encoding_format") or "float"
        if str(fmt).lower() not in ("float", "base64"):
            raise ApiError(400, f"Invalid value for 'encoding_format' = {fmt}. Supported values: "
                           "['float', 'base64'].")
        name = model_name(body, state)
    except ApiError as exc:
        return openai_error(exc.status, exc.message)
    asked = body.get("dimensions")
    dim = asked if isinstance(asked, int) and not isinstance(asked, bool) else EMBEDDING_DIM
    async with state.use(name, None) as model, state.slot(model):
        data = [{"object": "embedding", "embedding": embedding(text, max(1, dim)), "index": i}
                for i, text in enumerate(texts)]
    tokens = sum(count_tokens(text) for text in texts)
    return web.json_response({"object": "list", "data": data, "model": body.get("model"),
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _models(request: web.Request) -> web.Response:
    state: OllamaState = request.app[OLLAMA_STATE_KEY]
    data = [{"id": name, "object": "model", "created": int(when),
             "owned_by": _namespace(name)} for name, when in sorted(state.installed().items())]
    return web.json_response({"object": "list", "data": data})


def _namespace(name: str) -> str:
    """Ollama's ``model.ParseName(name).Namespace``: ``library`` for a plain name."""
    parts = normalize_model_name(name).split(":")[0].split("/")
    return parts[-2] if len(parts) >= 2 else "library"


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_get("/v1/models", _models)
