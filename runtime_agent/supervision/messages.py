"""What reaches an engine's owner: intents from callers and events from its helpers, as types.

An owner's inbox takes one message at a time, and each message says what it carries: a frozen
Struct per kind (msgspec), dispatched with ``match``. Events from the engine's helpers carry the
generation of the process they were about; the owner drops those of a process that is gone.
"""

from __future__ import annotations

import asyncio
import enum
from typing import TYPE_CHECKING

from msgspec import Struct

from engines.driver import Observation
from engines.process import ExitInfo
from runtime_agent.kv.segment import SegmentInfo
from runtime_agent.supervision.outcomes import Outcome

if TYPE_CHECKING:
    from runtime_agent.artifacts.staging import StagingView


class Action(enum.StrEnum):
    SLEEP = "sleep"
    WAKE = "wake"
    STOP = "stop"
    KV_LIMIT = "kv_limit"
    REVIVE = "revive"
    LOAD_ADAPTER = "load_adapter"
    UNLOAD_ADAPTER = "unload_adapter"


class StartMode(enum.StrEnum):
    """How an owner begins: what the pool or the recovery found."""

    SPAWN = "spawn"  # a new engine: write the record, then start the process
    ADOPT = "adopt"  # a running engine, verified by the caller (PID, start time, engine id)
    RESTART = "restart"  # its process is gone: restart now, counted against the budget
    IDLE = "idle"  # it had failed for good: keep it as it is
    STOP = "stop"  # the previous agent died while stopping it: finish the stop


# ---- intents: what a caller asks of an engine ---------------------------------------------


class Sleep(Struct, frozen=True):
    level: int = 1
    operation_id: str | None = None
    action: Action = Action.SLEEP


class Wake(Struct, frozen=True):
    operation_id: str | None = None
    action: Action = Action.WAKE


class Stop(Struct, frozen=True):
    operation_id: str | None = None
    action: Action = Action.STOP


class Revive(Struct, frozen=True):
    """Activate again with the same spec: a failed engine starts over with a fresh budget."""

    operation_id: str | None = None
    action: Action = Action.REVIVE


class SetKvLimit(Struct, frozen=True):
    limit_bytes: int
    operation_id: str | None = None
    action: Action = Action.KV_LIMIT


class LoadAdapter(Struct, frozen=True):
    name: str
    path: str
    artifact_url: str | None = None
    operation_id: str | None = None
    action: Action = Action.LOAD_ADAPTER


class UnloadAdapter(Struct, frozen=True):
    name: str
    operation_id: str | None = None
    action: Action = Action.UNLOAD_ADAPTER


Intent = Sleep | Wake | Stop | Revive | SetKvLimit | LoadAdapter | UnloadAdapter


# ---- the inbox ----------------------------------------------------------------------------


class Request(Struct, frozen=True):
    """An intent and the future its caller awaits."""

    intent: Intent
    reply: asyncio.Future[Outcome]


class TurnGranted(Struct, frozen=True):
    """The device gate gave this engine its turn to start on its cards."""

    token: int
    reason: str


class StagingProgress(Struct, frozen=True):
    """The weight cache's progress on the artifact this engine waits for (``token``: which
    wait)."""

    token: int
    view: StagingView


class Staged(Struct, frozen=True):
    """The wait for the weight cache ended: the local path to start on, or why it failed."""

    token: int
    reason: str
    path: str | None
    error: str | None


class FromProcess(Struct, frozen=True):
    """An event about one process of the engine: ``gen`` names which."""

    gen: int


class Exited(FromProcess, frozen=True):
    info: ExitInfo


class Unusable(FromProcess, frozen=True):
    """Stuck, unloadable or unresponsive: end this process; its exit decides what follows."""

    why: str


class Ready(FromProcess, frozen=True):
    """The engine answered its health endpoint; ``sleeping`` is its own word, if it gave one."""

    sleeping: bool | None


class Health(FromProcess, frozen=True):
    """One periodic probe: did the engine answer, and what did it say about sleep."""

    answered: bool
    sleeping: bool | None
    failures: int  # consecutive probes without an answer, this one included


class KvReading(FromProcess, frozen=True):
    info: SegmentInfo | None
    writes: int | None = None  # the agent's own writes finished before it was read


class Figures(FromProcess, frozen=True):
    observation: Observation


class OpDone(FromProcess, frozen=True):
    """A sleep or wake call returned (or failed); ``sleeping`` is the engine's word after it."""

    action: Action
    level: int
    error: str | None
    sleeping: bool | None
    request: Request | None
    seconds: float


class AdapterDone(FromProcess, frozen=True):
    """A LoRA load or unload returned: ``error`` and the engine's ``status`` when it failed."""

    action: Action
    name: str
    error: str | None
    status: int | None
    request: Request | None


class AdaptersSynced(FromProcess, frozen=True):
    """After a start or a re-adoption: what the engine serves now, and what failed to load."""

    loaded: frozenset[str]
    failed: tuple[tuple[str, str], ...]


class RestartDue(FromProcess, frozen=True):
    """The backoff delay before a restart has passed."""


class PersistDue(Struct, frozen=True):
    """Time to try a record write that failed again."""


class SpawnRetry(FromProcess, frozen=True):
    """Try a start again (its port was held by another process); no restart is counted."""

    reason: str


Message = (Request | TurnGranted | StagingProgress | Staged | Exited | Unusable | Ready | Health | KvReading | Figures
           | OpDone | AdapterDone | AdaptersSynced | RestartDue | PersistDue | SpawnRetry)
