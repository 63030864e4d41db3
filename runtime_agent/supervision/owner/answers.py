"""The outcomes an owner's parts answer with, written once for all of them."""

from __future__ import annotations

import asyncio
from typing import Any

from contract.phases import Phase
from runtime_agent.gpu.admission import Refuse
from runtime_agent.supervision.messages import Intent, Request
from runtime_agent.supervision.outcomes import Done, Outcome, Refusal, Refused


def resolve(future: asyncio.Future[Outcome], outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)


def no_room(refused: Refuse, message: str, **extra: Any) -> Refused:
    """A memory refusal as an outcome: what was needed, what is free, who holds it."""
    kind = Refusal.NO_ROOM if refused.reason != "TooLargeForAnyCard" else Refusal.INVALID
    return Refused(kind, message, refused.reason, details={
        "needed_bytes": refused.needed, "free_bytes": refused.free,
        "holders": [{"model_name": k, "bytes": b} for k, b in refused.holders]}, **extra)


def done(name: str, phase: Phase | None, intent: Intent, changed: bool = True,
         details: dict[str, Any] | None = None) -> Done:
    return Done(name, phase, changed, intent.operation_id, details or {})


def refuse(request: Request, kind: Refusal, message: str, name: str, phase: Phase) -> None:
    resolve(request.reply, Refused(kind, message, model_name=name, phase=phase,
                                   operation_id=request.intent.operation_id))
