"""The control and snapshot HTTP API (aiohttp): thin handlers over the engine pool.

Handlers parse and validate, send one intent, and return the result as JSON. One middleware
turns every failure into ``{"status": "error", "message": ...}`` with a 4xx that says what to
fix, or a 500 that names the error without a traceback (the traceback goes to the agent log).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from runtime_agent.api import artifacts as artifact_routes
from runtime_agent.api.metrics import CONTENT_TYPE
from runtime_agent.api.models import (
    ActivateRequest,
    DeactivateRequest,
    KvLimitRequest,
    SleepRequest,
    WakeRequest,
    describe_validation_error,
)
from runtime_agent.supervision.owner import Intent
from runtime_agent.supervision.views import OpResult

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
AGENT_KEY: web.AppKey[Any] = web.AppKey("agent", object)
MAX_BODY = 1024 * 1024


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"status": "error", "message": message}, status=status)


@web.middleware
async def errors(request: web.Request,
                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(exc.status, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"no such endpoint: {request.method} {request.path}"
        elif exc.status == 405:
            message = f"{request.method} is not allowed on {request.path}"
        return error_response(exc.status, message)
    except Exception as exc:  # a bug; keep the details in the log, not in the response
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, f"internal error ({type(exc).__name__}); see the agent log")


async def parse(request: web.Request, model: type[M]) -> M:
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise BadRequest(f"request body is larger than {MAX_BODY} bytes", 413)
    raw = await request.read()
    if not raw:
        raise BadRequest("request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadRequest(describe_validation_error(exc)) from exc


def reply(result: OpResult) -> web.Response:
    return web.json_response(result.body, status=result.status)


def _agent(request: web.Request) -> Any:
    return request.app[AGENT_KEY]


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def activate(request: web.Request) -> web.Response:
    req = await parse(request, ActivateRequest)
    return reply(await _agent(request).pool.activate(req.activation()))


async def deactivate(request: web.Request) -> web.Response:
    req = await parse(request, DeactivateRequest)
    return reply(await _agent(request).pool.deactivate(req.model_name))


async def sleep(request: web.Request) -> web.Response:
    req = await parse(request, SleepRequest)
    intent = Intent("sleep", req.operation_id, req.level)
    return reply(await _agent(request).pool.lifecycle(req.model_name, intent))


async def wake(request: web.Request) -> web.Response:
    req = await parse(request, WakeRequest)
    intent = Intent("wake", req.operation_id)
    return reply(await _agent(request).pool.lifecycle(req.model_name, intent, req.wait_seconds))


async def kv_limit(request: web.Request) -> web.Response:
    req = await parse(request, KvLimitRequest)
    intent = Intent("kv_limit", req.operation_id, limit_bytes=req.limit_bytes)
    return reply(await _agent(request).pool.lifecycle(req.model_name, intent))


async def models(request: web.Request) -> web.Response:
    return web.json_response(_agent(request).model_list())


async def snapshot(request: web.Request) -> web.Response:
    return web.json_response(_agent(request).snapshot())


def _int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"query parameter {name} must be a whole number, got {raw!r}") from None
    if not low <= value <= high:
        raise BadRequest(f"query parameter {name} must be between {low} and {high}")
    return value


async def events(request: web.Request) -> web.Response:
    since = _int_query(request, "since", 0, 0, 2**62)
    wait = _int_query(request, "wait", 0, 0, 60)
    feed = _agent(request).events
    if wait:
        await feed.wait_after(since, wait)
    items = feed.since(since)
    return web.json_response({"events": items, "cursor": items[-1]["seq"] if items else since})


async def event_stream(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: the backlog after the cursor, then each event as it happens.

    The cursor is ``?since=N`` or the standard ``Last-Event-ID`` header of a reconnecting
    client. A client whose cursor fell out of the ring first gets a ``gap`` event.
    """
    header = request.headers.get("Last-Event-ID")
    cursor = _int_query(request, "since", 0, 0, 2**62)
    if header is not None and header.isdigit():
        cursor = int(header)
    feed = _agent(request).events
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    if feed.first_seq > cursor + 1 and cursor < feed.last_seq:
        gap = {"missed_from": cursor + 1, "missed_to": feed.first_seq - 1}
        await resp.write(f"event: gap\ndata: {json.dumps(gap)}\n\n".encode())
    while True:
        for item in feed.since(cursor):
            cursor = item["seq"]
            await resp.write(f"id: {cursor}\ndata: {json.dumps(item)}\n\n".encode())
        await feed.wait_after(cursor, 15.0)
        if feed.last_seq <= cursor:
            await resp.write(b": keep-alive\n\n")


async def metrics(request: web.Request) -> web.Response:
    body = _agent(request).metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def engine_logs(request: web.Request) -> web.Response:
    tail = _int_query(request, "tail", 100, 1, 10000)
    lines = await _agent(request).log_tail(request.match_info["model"], tail)
    if lines is None:
        raise BadRequest(f"model {request.match_info['model']!r} is not on this agent", 404)
    return web.json_response({"model_name": request.match_info["model"], "lines": lines})


def make_app(agent: Any) -> web.Application:
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY)
    app[AGENT_KEY] = agent
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/v1/runtime/models/activate", activate)
    app.router.add_post("/v1/runtime/models/deactivate", deactivate)
    app.router.add_post("/v1/runtime/models/sleep", sleep)
    app.router.add_post("/v1/runtime/models/wake", wake)
    app.router.add_post("/v1/runtime/models/kv-limit", kv_limit)
    app.router.add_get("/v1/runtime/models", models)
    app.router.add_get("/v1/runtime/models/{model:.+}/logs", engine_logs)
    app.router.add_get("/v1/runtime/snapshot", snapshot)
    app.router.add_get("/v1/runtime/events", events)
    app.router.add_get("/v1/runtime/events/stream", event_stream)
    app.router.add_get("/metrics", metrics)
    artifact_routes.register(app, agent)  # issue 14 hook: /v1/model/download, list, delete
    return app
