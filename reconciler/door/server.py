"""The door's HTTP server: OpenAI's inference routes, and nothing else of an engine.

| method and path | what |
|---|---|
| ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` | routed by ``model`` |
| ``GET /v1/models``, ``GET /v1/models/{model}`` | every model the key may use, with ``max_model_len`` and ``state`` |
| ``POST`` the engines' other routes (``reconciler.door.endpoints``: responses, rerank, score, pooling, classify, tokenize, detokenize; Ollama's ``/api/chat``, ``/api/generate``) | routed by ``model``, held, keyed and counted as chat |
| ``GET /api/tags``, ``GET /api/ps`` | the door's Ollama claims, Ollama's shape (``reconciler.door.ollama``) |
| ``POST /v1/models/{model}/release`` | with ``--door-allow-release``: sleep the model now (``reconciler.door.release``) |
| ``GET /healthz`` | ``{"status": "ok"}`` (no key needed); on a standby 503 ``standby`` |

Everything else is a 404 in OpenAI's error format: no engine's sleep, wake, LoRA, metrics, RPC
or debug route is reachable through the door. With API keys configured, every route but ``/healthz``
needs ``Authorization: Bearer KEY`` (401 without a valid one). A replica that cannot serve (a
Kubernetes standby: ``Door.standby``) answers every route 503 ``not_leading`` before anything
else: it has no claims to answer from, and must never route.

A known route asked with another method is a 405 (``Allow`` names the one it takes). The HTTP
server is the door's own (``reconciler.door.http1``): a client that disconnects cancels its
handler, so a held request leaves its queue at once and a forwarded one closes its engine
connection. Every inference request, answered by an engine or by the door, is counted in the
metrics and written to the access log.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from guard import jsonbody
from reconciler.door import errors, release
from reconciler.door.access import AccessLog, AccessRecord
from reconciler.door.door import Door, Refused
from reconciler.door.ledger import Ticket
from reconciler.door.endpoints import ENDPOINTS
from reconciler.door.http1 import Answer, Request, Server, Stream, json_answer
from guard.access import Audit, Refusal, check
from reconciler.door.keys import Key, KeyFile
from reconciler.door.ollama import Listing
from reconciler.door.proxy import Outcome, usage_of

MODELS = "/v1/models"
LISTS = {"/api/tags": "tags", "/api/ps": "ps"}  # Ollama's, of the door's Ollama claims
CLIENT_CLOSED = 499  # nginx's code for a client that went away before the answer
READS = ("GET", "HEAD")


class DoorRoutes:
    """The door's routes over its HTTP server: ``await handle(request)``."""

    def __init__(self, door: Door, keys: KeyFile, access_log: AccessLog) -> None:
        self.door = door
        self.keys = keys
        self.access_log = access_log
        self.audit = Audit("door")  # refusals; accepted requests are in the access log

    async def handle(self, request: Request) -> Answer | Stream:
        path, method = request.path, request.method
        known = ENDPOINTS.get(path)
        if known is not None:
            if method == "POST":
                return await self.infer(request, known[0])
            return _wrong_method(request, "POST")
        if method == "POST" and path.startswith(MODELS + "/") and path.endswith(release.SUFFIX) \
                and len(path) > len(MODELS) + 1 + len(release.SUFFIX):
            return await self.release(request, path[len(MODELS) + 1:-len(release.SUFFIX)])
        if path == MODELS or path.startswith(MODELS + "/") and len(path) > len(MODELS) + 1:
            if method in READS:
                return await self.models(request, path[len(MODELS) + 1:] or None)
            return _wrong_method(request, "GET")
        which = LISTS.get(path)
        if which is not None:
            if method in READS:
                return await self.ollama_list(request, which)
            return _wrong_method(request, "GET")
        if path == "/healthz":
            if method in READS:
                return self.healthz()
            return _wrong_method(request, "GET")
        return errors.error_response(404, f"No such endpoint: {method} {path}. The door serves "
                                     f"{', '.join(ENDPOINTS)}, {MODELS}, {', '.join(LISTS)}.",
                                     "invalid_request_error", "unknown_url")

    def too_large(self) -> Answer:
        answer = errors.error_response(413, f"The request body is larger than "
                                       f"{self.door.settings.max_body_bytes} bytes.",
                                       "invalid_request_error", "body_too_large")
        answer.close = True  # its body is not read
        return answer

    def _serving(self) -> None:
        """``Refused`` while this replica cannot serve (a standby)."""
        why = self.door.standby()
        if why is not None:
            raise Refused(errors.not_serving(why), "not_leading")

    def _authorize(self, request: Request) -> Key | None:
        """The request's API key (None when the door asks for none); ``Refused`` without one."""
        keys = self.keys
        if not keys.enabled:
            return None
        header = request.headers.get("authorization")  # repeats arrive joined: refused
        found = check(keys.credentials(), [header] if header is not None else [], "door")
        if isinstance(found, Refusal):  # guard.access's check and audit line, OpenAI's shape
            self.audit.refused(request.method, request.path, request.remote, found)
            raise Refused(errors.unauthorized(found.message), "unauthorized")
        return found

    def _caller(self, request: Request) -> tuple[Key | None, Answer | None]:
        """(the API key, None) for a replica that serves and a caller with a valid key, else
        (None, the refusal)."""
        try:
            self._serving()
            return self._authorize(request), None
        except Refused as refused:
            return None, refused.response

    async def infer(self, request: Request, endpoint: str) -> Answer | Stream:
        door = self.door
        rec = AccessRecord("POST", request.path, request.remote, time.monotonic())
        outcome = Outcome()
        ticket = Ticket(door.ledger)
        reason: str | None = None
        response: Answer | Stream | None = None
        try:
            self._serving()
            key = self._authorize(request)
            rec.key = key.id if key else None
            body = request.body
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
            # metrics and the access line after the answer is sent: the server writes an
            # answer in the step this handler returns in, before the loop runs this
            asyncio.get_running_loop().call_soon(self._account, endpoint, rec, outcome, response,
                                                 reason, time.monotonic())

    def _account(self, endpoint: str, rec: AccessRecord, outcome: Outcome,
                 response: Answer | Stream | None, reason: str | None, now: float) -> None:
        metrics = self.door.metrics
        label = rec.model if rec.claim is not None and rec.model else ""
        if reason == "client_disconnected":
            status = CLIENT_CLOSED
        elif outcome.status:
            status = outcome.status
        else:
            status = response.status if isinstance(response, Answer) else 500
        rec.status, rec.stream, rec.bytes, rec.error = (status, outcome.stream, outcome.bytes_out,
                                                        reason)
        rec.duration_ms = round((now - rec.started) * 1000, 3)
        if outcome.upstream_s is not None:
            rec.upstream_ms = round(outcome.upstream_s * 1000, 3)
        if outcome.first_byte is not None:
            rec.ttft_ms = round((outcome.first_byte - rec.started) * 1000, 3)
            metrics.first_token(label, outcome.first_byte - rec.started)
        usage = usage_of(outcome.usage_from) if outcome.usage_from else None
        if usage is not None and any(usage):
            rec.prompt_tokens, rec.completion_tokens = usage
            metrics.usage(label, *usage)
        metrics.answered(label, endpoint, status, now - rec.started)
        if reason is not None:
            metrics.failed(label, reason)
        self.access_log.write(rec)

    async def models(self, request: Request, name: str | None) -> Answer:
        """``GET /v1/models`` and ``GET /v1/models/{model}``."""
        door = self.door
        key, refused = self._caller(request)
        if refused is not None:
            return refused
        await door.refresh_names()
        listed = door.listing(key)
        if name is None:
            return json_answer({"object": "list", "data": listed})
        found = [m for m in listed if m["id"] == name]
        if not found:
            return errors.unknown_model(name, door.visible_names(key))
        return json_answer(found[0])

    async def release(self, request: Request, name: str) -> Answer:
        """``POST /v1/models/{model}/release`` (``reconciler.door.release``)."""
        key, refused = self._caller(request)
        if refused is not None:
            return refused
        answer = await release.release(self.door, name, key)
        self.audit_release(request, name, key, answer)
        return answer

    def audit_release(self, request: Request, name: str, key: Key | None,
                      answer: Answer) -> None:
        rec = AccessRecord("POST", request.path, request.remote, time.monotonic())
        rec.model, rec.key, rec.status = name, key.id if key else None, answer.status
        self.access_log.write(rec)

    async def ollama_list(self, request: Request, which: str) -> Answer:
        """``GET /api/tags`` and ``GET /api/ps``: the door's Ollama claims, Ollama's shape."""
        door = self.door
        key, refused = self._caller(request)
        if refused is not None:
            return refused
        return json_answer(await Listing(door.upstream).build(which, door.ollama_claims(key)))

    def healthz(self) -> Answer:
        why = self.door.standby()
        if why is not None:
            return json_answer({"status": "standby", "message": why}, 503,
                               {"Retry-After": str(errors.NOT_SERVING_RETRY_AFTER)}, close=True)
        return json_answer({"status": "ok"})


def _wrong_method(request: Request, allowed: str) -> Answer:
    answer = errors.error_response(405, f"{request.path} takes {allowed}, not {request.method}.",
                                   "invalid_request_error", "method_not_allowed")
    answer.headers["Allow"] = allowed if allowed == "POST" else "GET, HEAD"
    return answer


def _document(body: bytes) -> dict[str, Any]:
    try:
        doc = jsonbody.loads(body)
    except jsonbody.JsonTooDeep as err:
        raise Refused(errors.error_response(422, f"The request body is refused: {err}.",
                                            "invalid_request_error", "json_too_deep"),
                      "bad_request") from None
    except jsonbody.JsonBodyError as err:
        raise Refused(errors.bad_request(f"The request body is not valid JSON: {err}"),
                      "bad_request") from None
    if not isinstance(doc, dict):
        raise Refused(errors.bad_request("The request body must be a JSON object."),
                      "bad_request")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise Refused(errors.bad_request("The request names no model: give 'model' (see GET "
                                         "/v1/models).", "model"), "bad_request")
    return doc


def make_server(door: Door, keys: KeyFile, access_log: AccessLog,
                shutdown_s: float = 2.0) -> Server:
    routes = DoorRoutes(door, keys, access_log)
    return Server(routes.handle, max_body=door.settings.max_body_bytes,
                  too_large=routes.too_large, shutdown_s=shutdown_s,
                  limits=door.settings.limits())
