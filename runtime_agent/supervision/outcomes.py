"""What an owner or the pool answers: domain outcomes, never HTTP statuses.

The API layer maps each outcome to a status and a body in one table
(``runtime_agent.api.replies``); the supervision code says only what happened: the intent is
in force (``Done``, with ``changed`` telling whether this call changed anything), it was
refused and why, the model is not here, or the engine failed while doing it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from msgspec import Struct, field

from contract.phases import Phase


class Refusal(enum.StrEnum):
    """Why a request was refused, in the words that decide what the caller should do."""

    INVALID = "invalid"  # it can never succeed as written: fix the request
    CONFLICT = "conflict"  # not in this state, or another request holds it: retry later
    NO_ROOM = "no_room"  # not enough memory now; may fit later (reason InsufficientGPUMemory)
    UNAVAILABLE = "unavailable"  # the agent cannot do it now (no port, storage, executable)


class Done(Struct, frozen=True):
    """The intent is in force. ``changed`` is False when this call changed nothing: already
    so, or an operation id answered before."""

    model_name: str
    phase: Phase | None
    changed: bool = True
    operation_id: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)


class Refused(Struct, frozen=True):
    kind: Refusal
    message: str
    reason: str | None = None  # a contract reason name (InsufficientGPUMemory, ...)
    model_name: str | None = None
    phase: Phase | None = None
    operation_id: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)


class NotFound(Struct, frozen=True):
    model_name: str
    message: str


class EngineFailed(Struct, frozen=True):
    """The engine was asked and failed, or did not answer within the call's bound."""

    model_name: str
    message: str
    phase: Phase | None = None
    operation_id: str | None = None


Outcome = Done | Refused | NotFound | EngineFailed
