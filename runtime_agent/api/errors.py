"""Errors at the HTTP edge: one middleware that turns every failure into a JSON answer, and the
request parser that turns a body that does not validate into a 422 (one nested too deep too:
``guard.jsonbody``, before anything recurses into it).

A refusal says what to fix, as ``{"status": "error", "message": ...}``; a body that does not
validate also carries FastAPI's ``detail`` list, as the AIBrix sidecar answers it. A bug is a
500 that names the error type, never a traceback (that goes to the agent log).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from pydantic import ValidationError

from guard import jsonbody

if TYPE_CHECKING:
    from pydantic import BaseModel, TypeAdapter

log = logging.getLogger(__name__)
M = TypeVar("M", bound="BaseModel")
T = TypeVar("T")
MAX_BODY = 1024 * 1024


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


def error_response(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"status": "error", "message": message, **extra}, status=status)


@web.middleware
async def errors(request: web.Request,
                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        response = error_response(exc.status, str(exc), **exc.extra)
        if "retry_after" in exc.extra:
            response.headers["Retry-After"] = str(exc.extra["retry_after"])
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"no such endpoint: {request.method} {request.path}"
        elif exc.status == 405:
            message = f"{request.method} is not allowed on {request.path}"
        response = error_response(exc.status, message)
        if "Allow" in exc.headers:  # RFC 9110: a 405 says what is allowed
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception as exc:  # a bug; keep the details in the log, not in the response
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, f"internal error ({type(exc).__name__}); see the agent log")


def _unprocessable(message: str, kind: str, msg: str) -> BadRequest:
    return BadRequest(message, 422, detail=[{"type": kind, "loc": ["body"], "msg": msg}])


async def parse(request: web.Request, model: type[M]) -> M:
    """The request's JSON body as ``model``; a 413 when too large, a 422 when it does not
    validate (wrong JSON, wrong types, unknown fields)."""
    return await parse_with(request, model.model_validate_json)


async def parse_as(request: web.Request, adapter: TypeAdapter[T]) -> T:
    """As ``parse``, for any type pydantic validates (a union of request models, say: the
    422 then lists each branch's problems, as FastAPI does)."""
    return await parse_with(request, adapter.validate_json)


async def parse_with(request: web.Request, validate: Callable[[bytes], T]) -> T:
    """The request's JSON body, checked for size and depth, then given to ``validate``."""
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise BadRequest(f"request body is larger than {MAX_BODY} bytes", 413)
    raw = await request.read()
    if not raw.strip():
        raise _unprocessable("request body is empty; send a JSON object", "missing",
                             "Field required")
    try:
        data = jsonbody.loads(raw)
    except jsonbody.JsonTooDeep as exc:
        raise _unprocessable(f"request body is refused: {exc}", "json_invalid",
                             "JSON nested too deep") from None
    except jsonbody.JsonBodyError as exc:
        raise _unprocessable(f"request body is not valid JSON: {exc}", "json_invalid",
                             "JSON decode error") from None
    if not isinstance(data, dict):
        raise _unprocessable("request body must be a JSON object", "model_attributes_type",
                             "Input should be a valid dictionary or object")
    try:
        return validate(raw)
    except ValidationError as exc:
        raise BadRequest(describe_validation_error(exc), 422,
                         detail=validation_detail(exc)) from exc


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``field: what is wrong``."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "body"
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "is required"
        elif err["type"] == "extra_forbidden":
            msg = "is not a field of this request; remove it"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def validation_detail(exc: ValidationError) -> list[dict[str, Any]]:
    """FastAPI's ``detail`` list, as the AIBrix sidecar answers a body that does not validate."""
    detail = []
    for err in exc.errors(include_url=False, include_context=False):
        item: dict[str, Any] = {"type": err["type"], "loc": ["body", *err["loc"]],
                                "msg": err["msg"]}
        secret = bool(err["loc"]) and err["loc"][0] == "credentials"  # never echo a secret
        if (not secret and err["type"] != "extra_forbidden"
                and isinstance(err.get("input"), str | int | float | bool | None)):
            item["input"] = err.get("input")
        detail.append(item)
    return detail
