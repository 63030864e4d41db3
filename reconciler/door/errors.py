"""The door's answers in OpenAI's error format: ``{"error": {message, type, param, code}}``.

Clients of an OpenAI-compatible endpoint read ``error.code`` (``model_not_found``,
``context_length_exceeded``, ``invalid_api_key``) and ``error.type``; each answer says what to do
about it. A 503 carries ``Retry-After`` when waiting helps.

A replica that cannot serve at all (on Kubernetes: a standby, or a leader still reading the
cluster) answers every request ``not_serving``: 503, ``Retry-After: 1`` and ``Connection:
close``, so a client's retry opens a new connection, which the Service may send to the leader.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from reconciler.door.http1 import Answer


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}).encode()


def error_response(status: int, message: str, kind: str, code: str | None,
                   param: str | None = None, retry_after: int | None = None) -> Answer:
    headers = {"Content-Type": "application/json"}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return Answer(status, error_body(message, kind, code, param), headers)


def bad_request(message: str, param: str | None = None) -> Answer:
    return error_response(400, message, "invalid_request_error", None, param)


def unknown_model(model: str, known: Iterable[str]) -> Answer:
    names = sorted(known)
    listed = ", ".join(names) if names else "none yet"
    return error_response(404, f"The model `{model}` does not exist. Models served here: "
                          f"{listed}.", "invalid_request_error", "model_not_found", "model")


def not_allowed(model: str, allowed: Iterable[str]) -> Answer:
    names = ", ".join(sorted(allowed)) or "none"
    return error_response(403, f"This API key may not use the model `{model}`; it may use: "
                          f"{names}.", "invalid_request_error", "model_not_allowed", "model")


def unauthorized(message: str) -> Answer:
    response = error_response(401, message, "invalid_request_error", "invalid_api_key")
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def route_refused(refusal: Any) -> Answer:
    """A route's call that cannot be served (``reconciler.selection.refusals``): its status,
    code and message, Retry-After when waiting helps."""
    if refusal.status == 400:
        param = refusal.prompt.param if hasattr(refusal, "prompt") else None
        return error_response(400, refusal.message, "invalid_request_error", refusal.code,
                              param)
    return unavailable(refusal.message, refusal.code, refusal.retry_after)


def context_exceeded(message: str, param: str) -> Answer:
    return error_response(400, message, "invalid_request_error", "context_length_exceeded", param)


def unavailable(message: str, code: str, retry_after: int | None) -> Answer:
    return error_response(503, message, "service_unavailable", code, None, retry_after)


NOT_SERVING_RETRY_AFTER = 1  # the leader answers meanwhile; a takeover needs a Lease's time


def not_serving(message: str) -> Answer:
    response = error_response(503, message, "service_unavailable", "not_leading", None,
                              NOT_SERVING_RETRY_AFTER)
    response.close = True  # the retry comes on a new connection, perhaps to the leader
    return response


def upstream_failed(message: str) -> Answer:
    return error_response(502, message, "upstream_error", "upstream_error")


def upstream_timed_out(message: str) -> Answer:
    return error_response(504, message, "upstream_error", "upstream_timeout")


def stream_error_event(message: str) -> bytes:
    """The Server-Sent Event that ends a stream whose engine broke off (vLLM's own shape for an
    error in a stream: an ``error`` document, then ``[DONE]``)."""
    return (b"data: " + error_body(message, "upstream_error", "upstream_error") + b"\n\n"
            b"data: [DONE]\n\n")
