"""OpenAI-compatible inference endpoints of the simulated engine.

Clients, the agent's idleness checks and benchmarks talk to vLLM through ``/v1/completions`` and
``/v1/chat/completions``. These handlers reproduce vLLM's response shapes (ids, ``usage``, SSE chunks
ending in ``data: [DONE]``) and its error documents, while the "model" is the deterministic word
generator and the timing comes from the ``--sim-request-seconds`` / ``--sim-token-seconds`` knobs.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engines.sim.state import EngineAsleep, EngineState, WeightsDiscarded
from engines.sim.textgen import chat_prompt, count_tokens, finish_reason, generate_tokens

STATE_KEY: web.AppKey[EngineState] = web.AppKey("sim_state", EngineState)
DEFAULT_MAX_TOKENS = 16


def error_response(status: int, message: str, err_type: str) -> web.Response:
    """vLLM's error document; both the flat (older vLLM) and nested (newer vLLM) shapes are present."""
    error = {"message": message, "type": err_type, "param": None, "code": status}
    body = {"object": "error", **error, "error": error}
    return web.json_response(body, status=status)


class RequestError(Exception):
    """A client error that maps directly to an HTTP error document."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.response = error_response(status, message, err_type)


@dataclass(frozen=True)
class Job:
    """One parsed inference request."""

    kind: str  # "chat" or "completion"
    prompts: tuple[str, ...]
    max_tokens: int
    stream: bool
    include_usage: bool
    context: int = 1 << 62  # max_model_len: an answer stops where the context ends


async def read_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"Invalid JSON body: {exc}", "BadRequestError") from exc
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object", "BadRequestError")
    return body


def check_model(body: dict[str, Any], state: EngineState) -> None:
    """vLLM's check of the request's ``model``: absent, a served name or a loaded adapter."""
    model = body.get("model")
    if (model is not None and model not in state.options.served_model_names
            and model not in state.lora_adapters):
        raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")


def _parse_job(kind: str, body: dict[str, Any], state: EngineState) -> Job:
    options = state.options
    if options.runner == "pooling":  # vLLM registers no completion handler for a pooling model
        api = "Chat Completions" if kind == "chat" else "Completions"
        raise RequestError(400, f"The model does not support {api} API", "BadRequestError")
    check_model(body, state)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list", "BadRequestError")
        try:
            prompts: tuple[str, ...] = (chat_prompt(messages),)
        except ValueError as exc:
            raise RequestError(400, str(exc), "BadRequestError") from exc
        limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        max_tokens = body.get(limit_name)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = (prompt,)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = tuple(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompts = (" ".join(str(p) for p in prompt),)  # token ids: one prompt
        else:
            raise RequestError(400, "'prompt' must be a string or a list of strings", "BadRequestError")
        limit_name, max_tokens = "max_tokens", body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(400, "max_tokens must be an integer of at least 1", "BadRequestError")
    context = options.max_model_len
    # vLLM 0.32 (renderers/params.py, serve/utils/api_utils.get_max_tokens): an output limit over
    # the whole context and a prompt over it are refused; a limit that only leaves too little
    # room after the prompt is shortened to what is left.
    if max_tokens > context:
        raise RequestError(
            400, f"{limit_name}={max_tokens} cannot be greater than max_model_len={context}. "
            "Please request fewer output tokens.", "BadRequestError")
    for prompt_text in prompts:
        if (tokens := count_tokens(prompt_text)) > context:
            raise RequestError(
                400,
                f"This model's maximum context length is {context} tokens. However, your prompt "
                f"contains {tokens} input tokens, which exceeds this limit even without any output "
                "tokens. Please reduce the length of the input prompt.",
                "BadRequestError",
            )
    stream_options = body.get("stream_options") or {}
    include_usage = bool(isinstance(stream_options, dict) and stream_options.get("include_usage"))
    return Job(kind, prompts, max_tokens, bool(body.get("stream", False)), include_usage, context)


def _usage(prompts: tuple[str, ...], completion_tokens: int) -> dict[str, int]:
    prompt_tokens = sum(count_tokens(p) for p in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _choice(job: Job, index: int, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
    if job.kind == "completion":
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
    if text is None and not first:
        delta: dict[str, Any] = {}
    else:
        delta = {"role": "assistant", "content": text or ""} if first else {"content": text}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}


class _Completion:
    """Builds the documents of one response, sharing id/created/model between all chunks."""

    def __init__(self, job: Job, model: str) -> None:
        self.job = job
        prefix = "chatcmpl-" if job.kind == "chat" else "cmpl-"
        self.base = {"id": prefix + uuid.uuid4().hex, "created": int(time.time()), "model": model}
        self.obj = "chat.completion" if job.kind == "chat" else "text_completion"
        self.chunk_obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"

    def full(self, answers: list[tuple[list[str], str]]) -> dict[str, Any]:
        if self.job.kind == "chat":
            choices = [
                {"index": i, "message": {"role": "assistant", "content": "".join(tokens)}, "logprobs": None,
                 "finish_reason": finish}
                for i, (tokens, finish) in enumerate(answers)
            ]
        else:
            choices = [_choice(self.job, i, "".join(tokens), finish) for i, (tokens, finish) in enumerate(answers)]
        usage = _usage(self.job.prompts, sum(len(tokens) for tokens, _ in answers))
        return {**self.base, "object": self.obj, "choices": choices, "usage": usage}

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        doc: dict[str, Any] = {**self.base, "object": self.chunk_obj, "choices": choices}
        if usage is not None:
            doc["usage"] = usage
        return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def _stream(
    request: web.Request, job: Job, state: EngineState, out: _Completion
) -> tuple[web.StreamResponse, str]:
    """Send the SSE stream; return the response and the finished reason ("abort" if the client left)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    answers = _answers(job)
    try:
        await _write_events(response, job, state, out, answers)
    except ConnectionResetError:  # the client went away mid-stream, as vLLM counts it: an abort
        return response, "abort"
    return response, _reason(answers)


def _answers(job: Job) -> list[tuple[list[str], str]]:
    """Each prompt's tokens and finish reason: "length" when ``max_tokens`` cut it short."""
    answers = []
    for prompt in job.prompts:
        count, finish = finish_reason(prompt, min(job.max_tokens, job.context - count_tokens(prompt)))
        answers.append((generate_tokens(prompt, count), finish))
    return answers


def _reason(answers: list[tuple[list[str], str]]) -> str:
    """The request's ``finished_reason`` metric label."""
    return "length" if any(finish == "length" for _, finish in answers) else "stop"


async def _write_events(response: web.StreamResponse, job: Job, state: EngineState, out: _Completion,
                        answers: list[tuple[list[str], str]]) -> None:
    if job.kind == "chat":
        await response.write(out.chunk([_choice(job, i, None, None, first=True) for i in range(len(job.prompts))]))
    for position in range(max(len(tokens) for tokens, _ in answers)):
        if position and state.options.token_seconds:
            await asyncio.sleep(state.options.token_seconds)
        choices = [_choice(job, i, tokens[position], None) for i, (tokens, _) in enumerate(answers)
                   if position < len(tokens)]
        await response.write(out.chunk(choices))
    last_text = None if job.kind == "chat" else ""
    await response.write(out.chunk([_choice(job, i, last_text, finish) for i, (_, finish) in enumerate(answers)]))
    if job.include_usage:
        await response.write(out.chunk([], usage=_usage(job.prompts, sum(len(t) for t, _ in answers))))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        job = _parse_job(kind, await read_body(request), state)
    except RequestError as exc:
        return exc.response
    out = _Completion(job, state.options.served_model_name)
    try:
        async with state.slot():
            try:
                if state.options.request_seconds:
                    await asyncio.sleep(state.options.request_seconds)
                if job.stream:
                    response, reason = await _stream(request, job, state, out)
                else:
                    answers = _answers(job)
                    if state.options.token_seconds:
                        longest = max(len(tokens) for tokens, _ in answers)
                        await asyncio.sleep(state.options.token_seconds * max(0, longest - 1))
                    response = web.json_response(out.full(answers))
                    reason = _reason(answers)
            except asyncio.CancelledError:
                state.finished("abort")
                raise
            state.finished(reason)
            return response
    except EngineAsleep:
        return error_response(503, "The engine is sleeping; wake it up first.", "ServiceUnavailableError")
    except WeightsDiscarded as exc:
        return error_response(500, str(exc), "InternalServerError")


def _handler(kind: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _serve(request, kind)

    return handle


def add_routes(app: web.Application) -> None:
    """Register the OpenAI-compatible inference endpoints."""
    app.router.add_post("/v1/completions", _handler("completion"))
    app.router.add_post("/v1/chat/completions", _handler("chat"))
