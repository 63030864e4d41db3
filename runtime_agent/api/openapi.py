"""``GET /openapi.json``: the agent's API described from the same pydantic models it runs on.

Request bodies come from ``runtime_agent.api.models`` (the models the handlers validate with)
and answers from ``runtime_agent.api.schemas``, so the description cannot drift from the code.
The test suite fuzzes the live agent from this document (schemathesis).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import models_json_schema

from runtime_agent import __version__
from runtime_agent.api import models as req
from runtime_agent.api import schemas as ans
from runtime_agent.api.fresh import FRESH_KINDS

_REF = "#/components/schemas/{model}"
_ERRORS_POST = (400, 404, 409, 413, 422, 502, 503)
_ERRORS_LOCAL = (400, 403, 404, 409, 413, 422, 502, 503)  # 403: a local path outside the roots
_ERRORS_CACHE = (400, 403, 404, 409, 413, 422, 503)  # 503: the weight cache is off


@dataclass(frozen=True)
class Query:
    """A query parameter: an integer within bounds, or a string (one of ``choices`` if given)."""

    name: str
    text: str
    maximum: int | None = None
    minimum: int = 0
    choices: tuple[str, ...] = ()

    def schema(self) -> dict[str, Any]:
        if self.maximum is None:
            return {"type": "string", **({"enum": list(self.choices)} if self.choices else {})}
        return {"type": "integer", "minimum": self.minimum, "maximum": self.maximum}


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    summary: str
    body: type[BaseModel] | tuple[type[BaseModel], ...] | None
    answer: type[BaseModel] | None  # None: not JSON (the metrics text, the events stream)
    errors: tuple[int, ...] = ()
    query: tuple[Query, ...] = ()
    tags: tuple[str, ...] = field(default=("runtime",))
    media: str = "text/plain"  # what an answer that is not JSON is


ROUTES = (
    Route("get", "/healthz", "the agent process answers", None, ans.Health, tags=("health",)),
    Route("get", "/ready", "registry read and engines taken over", None, ans.Readiness,
          (503,), tags=("health",)),
    Route("post", "/v1/runtime/models/activate", "start an engine for a model",
          req.ActivateRequest, ans.ActivateAnswer, _ERRORS_POST),
    Route("post", "/v1/runtime/models/deactivate", "stop a model's engine",
          req.DeactivateRequest, ans.OperationAnswer, _ERRORS_POST),
    Route("post", "/v1/runtime/models/sleep", "put a model to sleep", req.SleepRequest,
          ans.OperationAnswer, _ERRORS_POST),
    Route("post", "/v1/runtime/models/wake", "wake a model", req.WakeRequest,
          ans.OperationAnswer, _ERRORS_POST),
    Route("post", "/v1/runtime/models/kv-limit", "set a model's KV-cache limit",
          req.KvLimitRequest, ans.OperationAnswer, _ERRORS_POST),
    Route("get", "/v1/runtime/models", "every engine, short", None, ans.ModelList),
    Route("get", "/v1/runtime/snapshot", "every engine and card, as the controller reads it",
          None, ans.Snapshot, (400, 404), (
              Query("fresh", "requests: read request figures from the engines now (the last "
                    "look before an idle sleep)", choices=FRESH_KINDS),
              Query("model", "with fresh: the engines to read (repeatable; default every one)"))),
    Route("get", "/v1/runtime/events", "engine events after a cursor (long-poll with wait)",
          None, ans.Events, (400,), (Query("since", "the last seq seen", 2**62),
                                     Query("wait", "seconds to wait for a new event", 60))),
    Route("get", "/v1/runtime/events/stream", "engine events as they happen (server-sent "
          "events; Last-Event-ID resumes)", None, None, media="text/event-stream"),
    Route("get", "/v1/runtime/models/{model}/logs", "the last lines of a model's engine log",
          None, ans.EngineLog, (400, 404), (Query("tail", "lines", 10000, 1),)),
    Route("get", "/v1/models", "served models and LoRA adapters (OpenAI's format)", None,
          ans.ServedModels, tags=("openai",)),
    Route("post", "/v1/lora_adapter/load", "load a LoRA adapter into an engine",
          (req.LoadLoraAdapterRuntimeRequest, req.LoadLoraAdapterRequest), ans.OperationAnswer,
          _ERRORS_LOCAL, tags=("lora",)),
    Route("post", "/v1/lora_adapter/unload", "unload a LoRA adapter",
          (req.UnloadLoraAdapterRuntimeRequest, req.UnloadLoraAdapterRequest),
          ans.OperationAnswer, _ERRORS_POST, tags=("lora",)),
    Route("post", "/v1/model/download", "stage an artifact in the weight cache (answers at "
          "once; GET /v1/model/list shows its progress)", req.DownloadRequest, ans.DownloadAnswer,
          _ERRORS_CACHE, tags=("artifacts",)),
    Route("get", "/v1/model/list", "the weight cache's entries", None, ans.ArtifactList,
          (503,), tags=("artifacts",)),
    Route("delete", "/v1/model/{artifact_id}", "free a cache entry no engine uses", None,
          ans.ArtifactFreed, (404, 409, 503), tags=("artifacts",)),
    Route("get", "/metrics", "Prometheus metrics", None, None, tags=("health",)),
)


def _all_models() -> list[type[BaseModel]]:
    found: dict[str, type[BaseModel]] = {m.__name__: m for m in (ans.ErrorAnswer,)}
    for route in ROUTES:
        bodies = route.body if isinstance(route.body, tuple) else (route.body,)
        for model in (*bodies, route.answer):
            if model is not None:
                found[model.__name__] = model
    return list(found.values())


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _operation(route: Route) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": route.summary, "tags": list(route.tags),
                          "operationId": route.method + route.path.replace("/", "_")
                          .replace("-", "_")}
    if route.body is not None:
        bodies = route.body if isinstance(route.body, tuple) else (route.body,)
        schema = _ref(bodies[0]) if len(bodies) == 1 else {"anyOf": [_ref(b) for b in bodies]}
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": schema}}}
    parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in re.findall(r"{(\w+)}", route.path)]
    parameters += [{"name": q.name, "in": "query", "required": False, "description": q.text,
                    "schema": q.schema()}
                   for q in route.query]
    if parameters:
        op["parameters"] = parameters
    if route.answer is None:
        ok: dict[str, Any] = {"description": "the exposition",
                              "content": {route.media: {"schema": {"type": "string"}}}}
    else:
        ok = {"description": "done",
              "content": {"application/json": {"schema": _ref(route.answer)}}}
    op["responses"] = {"200": ok}
    for status in route.errors:
        op["responses"][str(status)] = {
            "description": "refused; the message says what to fix",
            "content": {"application/json": {"schema": _ref(ans.ErrorAnswer)}}}
    return op


def openapi_document() -> dict[str, Any]:
    _, defs = models_json_schema([(m, "validation") for m in _all_models()],
                                 ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method] = _operation(route)
    return {"openapi": "3.1.0",
            "info": {"title": "warm-pool runtime agent", "version": __version__,
                     "description": "Supervises vLLM, SGLang and Ollama engines on a GPU node; a "
                     "superset of the AIBrix runtime sidecar's API."},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """One request model's JSON Schema (for tests and tools)."""
    return TypeAdapter(model).json_schema()
