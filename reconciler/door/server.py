"""The door's HTTP server: OpenAI's inference routes, and nothing else of an engine.

| method and path | what |
|---|---|
| ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` | routed by ``model`` |
| ``GET /v1/models``, ``GET /v1/models/{model}`` | every model the key may use, with ``max_model_len`` and ``state`` |
| ``GET /healthz`` | ``{"status": "ok"}`` (no key needed); on a standby 503 ``standby`` |

Everything else is a 404 in OpenAI's error format: no engine's sleep, wake, tokenize or debug
route is reachable through the door. With API keys configured, every route but ``/healthz``
needs ``Authorization: Bearer KEY`` (401 without a valid one). A replica that cannot serve (a
Kubernetes standby: ``Door.standby``) answers every route 503 ``not_leading`` before anything
else: it has no claims to answer from, and must never route.

The server runs with handler cancellation: a client that disconnects cancels its handler, so a
held request leaves its queue at once and a forwarded one closes its engine connection. Every
request, answered by an engine or by the door, is counted in the metrics and written to the
access log.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from reconciler.door import errors
from reconciler.door.access import AccessLog, AccessRecord
from reconciler.door.door import Door, Refused, Ticket
from reconciler.door.keys import Key, KeyFile, bearer
from reconciler.door.proxy import Outcome, usage_of
from reconciler.server import error_middleware

DOOR_KEY: web.AppKey[Door] = web.AppKey("door", Door)
KEYS_KEY: web.AppKey[KeyFile] = web.AppKey("keys", KeyFile)
LOG_KEY: web.AppKey[AccessLog] = web.AppKey("access_log", AccessLog)
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
             "/v1/embeddings": "embedding"}
CLIENT_CLOSED = 499  # nginx's code for a client that went away before the answer


def _peer(request: web.Request) -> str:
    return request.remote or "-"


def _render(request: web.Request, status: int, message: str) -> web.Response:
    """OpenAI-shaped errors for what aiohttp answers itself (no such route, too large)."""
    if status == 404:
        return errors.error_response(404, f"No such endpoint: {request.method} {request.path}. "
                                     f"The door serves {', '.join(ENDPOINTS)} and /v1/models.",
                                     "invalid_request_error", "unknown_url")
    if status == 413:
        return errors.error_response(413, f"The request body is larger than "
                                     f"{request.app[DOOR_KEY].settings.max_body_bytes} bytes.",
                                     "invalid_request_error", "body_too_large")
    return errors.error_response(status, message, "invalid_request_error" if status < 500
                                 else "server_error", None)


def _serving(door: Door) -> None:
    """``Refused`` while this replica cannot serve (a standby)."""
    why = door.standby()
    if why is not None:
        raise Refused(errors.not_serving(why), "not_leading")


def _authorize(request: web.Request) -> Key | None:
    """The request's API key (None when the door asks for none); ``Refused`` without one."""
    keys = request.app[KEYS_KEY]
    if not keys.enabled:
        return None
    given = bearer(request.headers.get("Authorization"))
    found = keys.lookup(given)
    if found is None:
        raise Refused(errors.unauthorized(
            "No API key given: send 'Authorization: Bearer KEY'." if given is None else
            "The API key given is not valid here."), "unauthorized")
    return found


async def infer(request: web.Request) -> web.StreamResponse:
    door = request.app[DOOR_KEY]
    endpoint = ENDPOINTS[request.path]
    rec = AccessRecord("POST", request.path, _peer(request), time.monotonic())
    outcome = Outcome()
    ticket = Ticket(door.ledger)
    reason: str | None = None
    response: web.StreamResponse | None = None
    try:
        _serving(door)
        key = _authorize(request)
        rec.key = key.id if key else None
        body = await request.read()
        doc = _document(body)
        rec.model = doc["model"]
        response = await door.serve(request, endpoint, doc, body, key, ticket, rec, outcome)
        reason = outcome.error
        return response
    except Refused as refused:
        reason, response = refused.reason, refused.response
        return response
    except asyncio.CancelledError:
        reason = "client_disconnected"
        raise
    finally:
        ticket.leave()
        # metrics and the access line after the answer is sent: this handler returns to
        # aiohttp, which writes the answer in the same step, before the loop runs this
        asyncio.get_running_loop().call_soon(_account, door, request, endpoint, rec, outcome,
                                             response, reason, time.monotonic())


def _document(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise Refused(errors.bad_request(f"The request body is not valid JSON: {err}"),
                      "bad_request") from err
    if not isinstance(doc, dict):
        raise Refused(errors.bad_request("The request body must be a JSON object."),
                      "bad_request")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise Refused(errors.bad_request("The request names no model: give 'model' (see GET "
                                         "/v1/models).", "model"), "bad_request")
    return doc


def _account(door: Door, request: web.Request, endpoint: str, rec: AccessRecord,
             outcome: Outcome, response: web.StreamResponse | None, reason: str | None,
             now: float) -> None:
    label = rec.model if rec.claim is not None and rec.model else ""
    if reason == "client_disconnected":
        status = CLIENT_CLOSED
    else:
        status = outcome.status or (response.status if response is not None else 500)
    rec.status, rec.stream, rec.bytes, rec.error = status, outcome.stream, outcome.bytes_out, reason
    rec.duration_ms = round((now - rec.started) * 1000, 3)
    if outcome.upstream_s is not None:
        rec.upstream_ms = round(outcome.upstream_s * 1000, 3)
    if outcome.first_byte is not None:
        rec.ttft_ms = round((outcome.first_byte - rec.started) * 1000, 3)
        door.metrics.first_token(label, outcome.first_byte - rec.started)
    usage = usage_of(outcome.usage_from) if outcome.usage_from else None
    if usage is not None and any(usage):
        rec.prompt_tokens, rec.completion_tokens = usage
        door.metrics.usage(label, *usage)
    door.metrics.answered(label, endpoint, status, now - rec.started)
    if reason is not None:
        door.metrics.failed(label, reason)
    request.app[LOG_KEY].write(rec)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models`` and ``GET /v1/models/{model}``."""
    door = request.app[DOOR_KEY]
    try:
        _serving(door)
        key = _authorize(request)
    except Refused as refused:
        return refused.response
    await door.refresh_names()
    listed = door.listing(key)
    name = request.match_info.get("model")
    if name is None:
        return web.json_response({"object": "list", "data": listed})
    found = [m for m in listed if m["id"] == name]
    if not found:
        return errors.unknown_model(name, door.visible_names(key))
    return web.json_response(found[0])


async def healthz(request: web.Request) -> web.Response:
    why = request.app[DOOR_KEY].standby()
    if why is not None:
        response = web.json_response({"status": "standby", "message": why}, status=503,
                                     headers={"Retry-After": str(errors.NOT_SERVING_RETRY_AFTER)})
        response.force_close()
        return response
    return web.json_response({"status": "ok"})


def make_app(door: Door, keys: KeyFile, access_log: AccessLog) -> web.Application:
    app = web.Application(middlewares=[error_middleware(_render)],
                          client_max_size=door.settings.max_body_bytes)
    app[DOOR_KEY] = door
    app[KEYS_KEY] = keys
    app[LOG_KEY] = access_log
    for path in ENDPOINTS:
        app.router.add_post(path, infer)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", models)
    app.router.add_get("/healthz", healthz)
    return app
