"""vLLM's other model routes on the simulated engine: score, rerank, pooling, classify, detokenize.

A client reaches these through the front door as it reaches chat, so the simulator answers them
with vLLM's shapes (``vllm/entrypoints/pooling/*/protocol.py``, ``serve/tokenize/protocol.py``):

* ``/score``, ``/v1/score`` ``{"text_1", "text_2"}`` (or ``queries``/``documents``) ->
  ``{"id": "score-..", "object": "list", "data": [{"index", "object": "score", "score"}], "usage"}``;
* ``/rerank``, ``/v1/rerank``, ``/v2/rerank`` ``{"query", "documents", "top_n"}`` (Jina's and
  Cohere's shape) -> ``{"id": "rerank-..", "model", "usage": {"total_tokens"}, "results":
  [{"index", "document": {"text"}, "relevance_score"}]}`` best first;
* ``/pooling`` -> ``{"object": "list", "data": [{"index", "object": "pooling", "data"}]}`` and
  ``/classify`` -> ``{"data": [{"index", "label", "probs", "num_classes"}]}``;
* ``/detokenize`` ``{"tokens"}`` -> ``{"prompt"}`` (any runner; it needs no weights).

vLLM registers score, rerank, pooling and classify only for a pooling model (``--runner
pooling``); a generative model answers them 404 as FastAPI does for a route it does not have.
Scores are deterministic: the cosine of the two texts' simulated embeddings. SGLang serves
``/v1/tokenize``, ``/v1/detokenize``, ``/v1/score``, ``/v1/rerank`` and ``/v1/classify`` under
the same shapes (``sglang_api`` adds them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from engines.sim.openai_api import STATE_KEY, RequestError, check_model, read_body
from engines.sim.state import EngineState
from engines.sim.textgen import count_tokens, embedding, word_of

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _texts(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise RequestError(400, f"'{name}' must be a string or a non-empty list of strings",
                       "BadRequestError")


def _similarity(a: str, b: str, dim: int) -> float:
    va, vb = embedding(a, dim), embedding(b, dim)
    return round((1.0 + sum(x * y for x, y in zip(va, vb))) / 2.0, 6)  # in [0, 1]


def _usage(tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _base(prefix: str, state: EngineState) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": state.options.served_model_name}


async def _body(request: web.Request) -> tuple[EngineState, dict[str, Any]]:
    state = request.app[STATE_KEY]
    body = await read_body(request)
    check_model(body, state)
    return state, body


def _score(state: EngineState, body: dict[str, Any]) -> dict[str, Any]:
    first = _texts(body.get("text_1", body.get("queries")), "text_1")
    second = _texts(body.get("text_2", body.get("documents")), "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise RequestError(400, "text_1 and text_2 must have the same length, or text_1 one "
                           "item", "BadRequestError")
    dim = state.options.embedding_dim
    data = [{"index": i, "object": "score", "score": _similarity(a, b, dim)}
            for i, (a, b) in enumerate(zip(first, second))]
    tokens = sum(count_tokens(a) + count_tokens(b) for a, b in zip(first, second))
    return {**_base("score", state), "data": data, "usage": _usage(tokens)}


def _rerank(state: EngineState, body: dict[str, Any]) -> dict[str, Any]:
    query = body.get("query")
    if not isinstance(query, str):
        raise RequestError(400, "'query' must be a string", "BadRequestError")
    docs = [d.get("text") if isinstance(d, dict) else d for d in body.get("documents") or []]
    documents = _texts(docs, "documents")
    top_n = body.get("top_n")
    dim = state.options.embedding_dim
    ranked = sorted(((i, _similarity(query, d, dim)) for i, d in enumerate(documents)),
                    key=lambda r: -r[1])
    if isinstance(top_n, int) and top_n > 0:
        ranked = ranked[:top_n]
    tokens = sum(count_tokens(query) + count_tokens(d) for d in documents)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": state.options.served_model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": [{"index": i, "document": {"text": documents[i]}, "relevance_score": s}
                        for i, s in ranked]}


def _pooling(state: EngineState, body: dict[str, Any]) -> dict[str, Any]:
    inputs = _texts(body.get("input"), "input")
    data = [{"index": i, "object": "pooling", "data": embedding(t, state.options.embedding_dim)}
            for i, t in enumerate(inputs)]
    return {**_base("pool", state), "data": data,
            "usage": _usage(sum(count_tokens(t) for t in inputs))}


def _classify(state: EngineState, body: dict[str, Any]) -> dict[str, Any]:
    inputs = _texts(body.get("input"), "input")
    data = []
    for i, text in enumerate(inputs):
        p = _similarity(text, "positive", state.options.embedding_dim)
        data.append({"index": i, "label": "positive" if p >= 0.5 else "negative",
                     "probs": [round(1.0 - p, 6), p], "num_classes": 2})
    return {**_base("classify", state), "data": data,
            "usage": _usage(sum(count_tokens(t) for t in inputs))}


def _detokenize(state: EngineState, body: dict[str, Any]) -> dict[str, Any]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in tokens):
        raise RequestError(400, "'tokens' must be a list of integers", "BadRequestError")
    words = [word_of(t) for t in tokens]
    return {"prompt": " ".join(words)}


def _route(build: Callable[[EngineState, dict[str, Any]], dict[str, Any]],
           pooling_only: bool) -> _Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        state: EngineState = request.app[STATE_KEY]
        if pooling_only and state.options.runner != "pooling":
            return web.json_response({"detail": "Not Found"}, status=404)  # not registered
        try:
            state, body = await _body(request)
            return web.json_response(build(state, body))
        except RequestError as exc:
            return exc.response

    return handle


def add_routes(app: web.Application, paths: Callable[[str], tuple[str, ...]] = lambda p: (p,)
               ) -> None:
    """vLLM's paths, or others for the same handler (SGLang: ``paths("/score")`` gives
    ``("/v1/score",)``)."""
    for path, build, pooling_only in (("/score", _score, True), ("/rerank", _rerank, True),
                                      ("/pooling", _pooling, True),
                                      ("/classify", _classify, True),
                                      ("/detokenize", _detokenize, False)):
        handler = _route(build, pooling_only)
        for served in paths(path):
            app.router.add_post(served, handler)


VLLM_PATHS = {"/score": ("/score", "/v1/score"),
              "/rerank": ("/rerank", "/v1/rerank", "/v2/rerank")}


def vllm_paths(path: str) -> tuple[str, ...]:
    return VLLM_PATHS.get(path, (path,))


SGLANG_PATHS = {"/score": ("/v1/score",), "/rerank": ("/v1/rerank",), "/pooling": (),
                "/classify": ("/v1/classify",), "/detokenize": ("/detokenize", "/v1/detokenize")}


def sglang_paths(path: str) -> tuple[str, ...]:
    return SGLANG_PATHS.get(path, (path,))


__all__ = ["add_routes", "sglang_paths", "vllm_paths"]
