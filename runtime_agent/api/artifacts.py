"""The weight cache's HTTP routes, as the AIBrix sidecar has them, plus a delete.

| route | result |
|---|---|
| ``POST /v1/model/download`` ``{artifact_url, credentials?, revision?}`` | starts or joins the download and answers at once: the entry (``artifact_id``, ``state``, bytes) and ``started`` |
| ``GET /v1/model/list`` | every entry: state (downloading, ready, failed), bytes done and total, rate, ETA, error |
| ``DELETE /v1/model/{artifact_id}`` | frees an entry no engine uses (409 names the engines that do) |

Validation errors are 422 with ``detail`` (as the sidecar's request models answer) and a
``message``; refusals say what to fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from runtime_agent.api.context import agent_of
from runtime_agent.api.errors import BadRequest, parse
from runtime_agent.artifacts.urls import ArtifactRequestError

if TYPE_CHECKING:  # the cache's modules load with the cache (--weight-cache-dir), not here
    from runtime_agent.artifacts.cache import ArtifactCache

CACHE_OFF = ("the weight cache is off: start the agent with AIBRIX_WEIGHT_CACHE_DIR set "
             "(or --weight-cache-dir DIR)")


def _cache(request: web.Request) -> ArtifactCache:
    cache: ArtifactCache | None = getattr(agent_of(request), "artifacts", None)
    if cache is None:
        raise BadRequest(CACHE_OFF, 503)
    return cache


async def download(request: web.Request) -> web.Response:
    cache = _cache(request)
    from runtime_agent.api import models  # its models load with the first body (issue 26)

    req = await parse(request, models.DownloadRequest)
    try:
        entry, started = await cache.request(req.artifact_url, req.revision, req.credentials)
    except ArtifactRequestError as exc:
        raise BadRequest(str(exc), exc.status) from exc
    item = next(i for i in cache.listing() if i["artifact_id"] == entry.entry_id)
    return web.json_response({"status": "success", "started": started, **item})


async def listing(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _cache(request).listing()})


async def delete(request: web.Request) -> web.Response:
    cache = _cache(request)
    entry_id = request.match_info["artifact_id"]
    try:
        entry = await cache.delete(entry_id)
    except ArtifactRequestError as exc:
        raise BadRequest(str(exc), exc.status) from exc
    return web.json_response({"status": "success", "artifact_id": entry_id,
                              "artifact_url": entry.ref.url, "message": "freed"})


def add_routes(app: web.Application) -> None:
    """The cache is ``agent.artifacts`` (None: the cache is off, and these answer 503)."""
    app.router.add_post("/v1/model/download", download)
    app.router.add_get("/v1/model/list", listing)
    app.router.add_delete("/v1/model/{artifact_id}", delete)
