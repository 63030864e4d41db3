"""The control and snapshot HTTP API (aiohttp): thin handlers over the engine pool.

Handlers parse and validate (``runtime_agent.api.errors``), send one intent, and turn its
outcome into a response (``runtime_agent.api.replies``). The request models are imported by
the handlers: pydantic builds them when the first body arrives, not at the agent's start
(issue 26: start-up time and memory are imports).
"""

from __future__ import annotations

import json
import logging

from aiohttp import web
from aiohttp_sse import sse_response

from contract.numbers import whole_number

from runtime_agent.api.context import agent_of
from runtime_agent.api.errors import BadRequest, parse
from runtime_agent.api.fresh import FRESH_KINDS, fresh_snapshot
from runtime_agent.api.metrics import CONTENT_TYPE
from runtime_agent.api.replies import reply
from runtime_agent.supervision.messages import SetKvLimit, Sleep, Wake

log = logging.getLogger(__name__)


async def healthz(request: web.Request) -> web.Response:
    agent = agent_of(request)
    return web.json_response(agent.health() if hasattr(agent, "health") else {"status": "ok"})


async def activate(request: web.Request) -> web.Response:
    from runtime_agent.api.models import ActivateRequest  # loaded with the first body

    req = await parse(request, ActivateRequest)
    return reply(await agent_of(request).pool.activate(req.activation()))


async def deactivate(request: web.Request) -> web.Response:
    from runtime_agent.api.models import DeactivateRequest  # loaded with the first body

    req = await parse(request, DeactivateRequest)
    return reply(await agent_of(request).pool.deactivate(req.model_name))


async def sleep(request: web.Request) -> web.Response:
    from runtime_agent.api.models import SleepRequest  # loaded with the first body

    req = await parse(request, SleepRequest)
    intent = Sleep(req.level, req.operation_id)
    return reply(await agent_of(request).pool.lifecycle(req.model_name, intent))


async def wake(request: web.Request) -> web.Response:
    from runtime_agent.api.models import WakeRequest  # loaded with the first body

    req = await parse(request, WakeRequest)
    intent = Wake(req.operation_id)
    return reply(await agent_of(request).pool.lifecycle(req.model_name, intent, req.wait_seconds))


async def kv_limit(request: web.Request) -> web.Response:
    from runtime_agent.api.models import KvLimitRequest  # loaded with the first body

    req = await parse(request, KvLimitRequest)
    intent = SetKvLimit(req.limit_bytes, req.operation_id)
    return reply(await agent_of(request).pool.lifecycle(req.model_name, intent))


def _rendered(request: web.Request, what: str) -> web.Response:
    """A document rendered once per change; ``If-None-Match`` with its ETag gets a 304."""
    body, etag = agent_of(request).rendered(what)
    if request.headers.get("If-None-Match") == etag:
        return web.Response(status=304, headers={"ETag": etag})
    return web.Response(body=body, content_type="application/json", headers={"ETag": etag})


async def models(request: web.Request) -> web.Response:
    return _rendered(request, "models")


async def snapshot(request: web.Request) -> web.Response:
    """The snapshot, rendered once per change; ``?fresh=requests`` reads request figures from
    the engines first (``model=`` names which; ``runtime_agent.api.fresh``)."""
    fresh = request.query.get("fresh")
    if fresh is None:
        return _rendered(request, "snapshot")
    if fresh not in FRESH_KINDS:
        raise BadRequest(f"query parameter fresh must be one of {', '.join(FRESH_KINDS)}, "
                         f"got {fresh!r}")
    return web.json_response(await fresh_snapshot(agent_of(request),
                                                  request.query.getall("model", [])))


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
    """Events after ``since``; ``wait`` long-polls for the next one. A ``boot_id`` from
    another boot of the agent gets ``reset: true`` and no events: re-list, then follow."""
    since = _int_query(request, "since", 0, 0, 2**62)
    wait = _int_query(request, "wait", 0, 0, 60)
    feed = agent_of(request).events
    boot = request.query.get("boot_id")
    if boot is not None and boot != feed.boot_id:
        return web.json_response({"events": [], "cursor": feed.last_seq, "boot_id": feed.boot_id,
                                  "reset": True, "message": "the agent restarted since that "
                                  "cursor: re-list (GET /v1/runtime/snapshot) and follow from "
                                  "the cursor given here"})
    if wait:
        async with agent_of(request).waiters.slot():
            await feed.wait_after(since, wait)
    items = feed.since(since)
    return web.json_response({"events": items, "cursor": items[-1]["seq"] if items else since,
                              "boot_id": feed.boot_id, "reset": False})


async def event_stream(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: the backlog after the cursor, then each event as it happens.

    The cursor is ``?since=N`` or the standard ``Last-Event-ID`` header (``BOOT:SEQ``) of a
    reconnecting client. A client whose cursor fell out of the ring first gets a ``gap`` event;
    one whose cursor is from another boot of the agent gets a ``reset`` event (re-list). At most
    ``MAX_STREAMS`` streams at once: more get a 503.
    """
    agent = agent_of(request)
    feed = agent.events
    header = request.headers.get("Last-Event-ID", "")
    cursor = _int_query(request, "since", 0, 0, 2**62)
    boot, _, seq = header.rpartition(":")
    reset = bool(boot) and boot != feed.boot_id  # a bare SEQ (an older client) is this boot's
    if header and not reset and (given := whole_number(seq)) is not None:
        cursor = given
    async with agent.streams.slot(), sse_response(request, sep="\n", ping_interval=15,
                                                  headers={"Cache-Control": "no-cache"}) as resp:
        # aiohttp-sse frames the events and sends a comment every 15 s to keep proxies open
        if reset:
            cursor = 0
            note = {"boot_id": feed.boot_id, "message": "the agent restarted: re-list"}
            await resp.send(json.dumps(note), event="reset")
        elif feed.first_seq > cursor + 1 and cursor < feed.last_seq:
            gap = {"missed_from": cursor + 1, "missed_to": feed.first_seq - 1}
            await resp.send(json.dumps(gap), event="gap")
        while True:
            for item in feed.since(cursor):
                cursor = item["seq"]
                await resp.send(json.dumps(item), id=f"{feed.boot_id}:{cursor}")
            if feed.closed:  # the agent stops; a follower reconnects with Last-Event-ID
                break
            await feed.wait_after(cursor, 15.0)
    return resp


async def metrics(request: web.Request) -> web.Response:
    body = agent_of(request).metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def engine_logs(request: web.Request) -> web.Response:
    tail = _int_query(request, "tail", 100, 1, 10000)
    lines = await agent_of(request).log_tail(request.match_info["model"], tail)
    if lines is None:
        raise BadRequest(f"model {request.match_info['model']!r} is not on this agent", 404)
    return web.json_response({"model_name": request.match_info["model"], "lines": lines})


def add_routes(app: web.Application) -> None:
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
