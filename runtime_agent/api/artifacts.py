"""The weight cache's HTTP routes, as the AIBrix sidecar has them, plus a delete.

| route | result |
|---|---|
| ``POST /v1/model/download`` ``{artifact_url, credentials?, revision?}`` | starts or joins the download and answers at once: the entry (``artifact_id``, ``state``, bytes) and ``started`` |
| ``GET /v1/model/list`` | every entry: state (downloading, ready, failed), bytes done and total, rate, ETA, error |
| ``DELETE /v1/model/{artifact_id}`` | frees an entry no engine uses (409 names the engines that do) |

Validation errors are 422 with ``detail`` (as the sidecar's request models answer) and a
``message``; refusals say what to fix. Registered by ``make_app`` with ``register``.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from runtime_agent.artifacts.cache import ArtifactCache
from runtime_agent.artifacts.urls import ArtifactRequestError

CACHE_KEY: web.AppKey[Any] = web.AppKey("artifact_cache", object)
MAX_BODY = 64 * 1024
CACHE_OFF = ("the weight cache is off: start the agent with AIBRIX_WEIGHT_CACHE_DIR set "
             "(or --weight-cache-dir DIR)")


class DownloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The sidecar's own request calls it model_uri; both spellings are taken.
    artifact_url: str = Field(min_length=1, max_length=2048,
                              validation_alias=AliasChoices("artifact_url", "model_uri"))
    credentials: dict[str, str] = Field(default_factory=dict)
    revision: str | None = Field(default=None, min_length=1, max_length=255)


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"status": "error", "message": message, **extra}, status=status)


def _cache(request: web.Request) -> ArtifactCache | None:
    agent = request.app[CACHE_KEY]
    return getattr(agent, "artifacts", None)


async def download(request: web.Request) -> web.Response:
    cache = _cache(request)
    if cache is None:
        return _error(503, CACHE_OFF)
    raw = await request.read()
    try:
        data = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(422, f"request body is not valid JSON: {exc}",
                      detail=[{"loc": ["body"], "msg": str(exc), "type": "json_invalid"}])
    try:
        req = DownloadRequest.model_validate(data)
    except ValidationError as exc:
        detail = exc.errors(include_url=False, include_context=False, include_input=False)
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                             for e in detail)
        return _error(422, problems, detail=detail)
    try:
        entry, started = await cache.request(req.artifact_url, req.revision, req.credentials)
    except ArtifactRequestError as exc:
        return _error(exc.status, str(exc))
    item = next(i for i in cache.listing() if i["artifact_id"] == entry.entry_id)
    return web.json_response({"status": "success", "started": started, **item})


async def listing(request: web.Request) -> web.Response:
    cache = _cache(request)
    if cache is None:
        return _error(503, CACHE_OFF)
    return web.json_response({"object": "list", "data": cache.listing()})


async def delete(request: web.Request) -> web.Response:
    cache = _cache(request)
    if cache is None:
        return _error(503, CACHE_OFF)
    entry_id = request.match_info["artifact_id"]
    try:
        entry = await cache.delete(entry_id)
    except ArtifactRequestError as exc:
        return _error(exc.status, str(exc))
    return web.json_response({"status": "success", "artifact_id": entry_id,
                              "artifact_url": entry.ref.url, "message": "freed"})


def register(app: web.Application, agent: Any) -> None:
    """Add the routes; ``agent.artifacts`` is the cache (None: the cache is off)."""
    app[CACHE_KEY] = agent
    app.router.add_post("/v1/model/download", download)
    app.router.add_get("/v1/model/list", listing)
    app.router.add_delete("/v1/model/{artifact_id}", delete)
