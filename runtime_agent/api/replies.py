"""Outcomes on the wire: the one table from domain outcomes to HTTP statuses and JSON bodies.

The supervision code answers ``Done``, ``Refused``, ``NotFound`` or ``EngineFailed``; this is
the only place that knows what each looks like to a client. Bodies keep the AIBrix runtime
sidecar's fields (``status``, ``model_name``, ``operation_id``, ``applied``, ``phase``): its
controller reads ``applied: false`` as "nothing changed", so ``applied`` is whether this call
changed anything, and ``in_force`` says whether the asked state now holds.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from runtime_agent.supervision.outcomes import (
    Done,
    EngineFailed,
    NotFound,
    Outcome,
    Refusal,
    Refused,
)

REFUSAL_STATUS = {
    Refusal.INVALID: 400,  # never succeeds as written
    Refusal.CONFLICT: 409,  # not in this state: retry later
    Refusal.NO_ROOM: 409,  # InsufficientGPUMemory: may fit later
    Refusal.UNAVAILABLE: 503,  # the agent cannot do it now
}


def status_and_body(outcome: Outcome) -> tuple[int, dict[str, Any]]:
    match outcome:
        case Done():
            body: dict[str, Any] = {"status": "success", "model_name": outcome.model_name,
                                    "applied": outcome.changed, "in_force": True}
            if outcome.operation_id is not None:
                body["operation_id"] = outcome.operation_id
            if outcome.phase is not None:
                body["phase"] = outcome.phase.value
            return 200, {**body, **outcome.details}
        case Refused():
            body = {"status": "error", "message": outcome.message, "applied": False}
            for key, value in (("reason", outcome.reason), ("model_name", outcome.model_name),
                               ("operation_id", outcome.operation_id),
                               ("phase", outcome.phase.value if outcome.phase else None)):
                if value is not None:
                    body[key] = value
            return REFUSAL_STATUS[outcome.kind], {**body, **outcome.details}
        case NotFound():
            return 404, {"status": "error", "message": outcome.message,
                         "model_name": outcome.model_name, "applied": False}
        case EngineFailed():
            body = {"status": "error", "message": outcome.message,
                    "model_name": outcome.model_name, "applied": False}
            if outcome.phase is not None:
                body["phase"] = outcome.phase.value
            if outcome.operation_id is not None:
                body["operation_id"] = outcome.operation_id
            return 502, body


def reply(outcome: Outcome) -> web.Response:
    status, body = status_and_body(outcome)
    return web.json_response(body, status=status)
