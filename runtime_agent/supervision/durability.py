"""Storage faults never cost control: a record write that fails is retried, never fatal.

A full (ENOSPC), read-only (EROFS) or failing (EIO) state directory must not end an engine's
owner: it keeps supervising its engine, reports the condition (the engine's
``StorageUnavailable``, ``/healthz``'s ``degraded``), and writes again after a growing pause
until a write succeeds. What cannot be made durable is refused instead: the pool and the
owners ask ``StorageHealth`` before a change a restarted agent would have to remember, and
answer 503 saying why; nothing is sent to an engine before its record is written. A stop
is the exception: on a read-only directory it is remembered beside the KV segments
(``registry.stops``) and made, since ending an engine is safe once a restarted agent will
finish the stop instead of starting the engine again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from contract.phases import Phase
from contract.reasons import STORAGE_UNAVAILABLE
from registry import stops
from runtime_agent.supervision.messages import PersistDue
from runtime_agent.supervision.outcomes import Refusal, Refused

if TYPE_CHECKING:
    from runtime_agent.supervision.owner import EngineOwner

FIRST_RETRY_S = 0.5
MAX_RETRY_S = 30.0


@dataclass
class StorageHealth:
    """The state directory as the owners last found it; one per agent, shared."""

    failing: dict[str, str] = field(default_factory=dict)  # engine id -> the last error

    @property
    def problem(self) -> str | None:
        return next(iter(self.failing.values()), None)

    def refusal(self, model_name: str | None) -> Refused | None:
        """A 503 for a change that could not be remembered now, or None."""
        if self.problem is None:
            return None
        return Refused(Refusal.UNAVAILABLE, f"the agent's state directory cannot be written "
                       f"({self.problem}); it would not remember this change after a restart, "
                       "so it refuses it until the directory is writable again",
                       STORAGE_UNAVAILABLE, model_name)


def write_failed(owner: EngineOwner, exc: OSError) -> None:
    """A record write failed: say so once, keep supervising, try again later."""
    error = f"{exc.strerror or exc} ({exc.__class__.__name__}, errno {exc.errno})"
    health = owner._deps.storage
    first = owner.record.engine_id not in health.failing
    health.failing[owner.record.engine_id] = error
    if first:
        owner._persist_retry_s = FIRST_RETRY_S
        owner._emit(STORAGE_UNAVAILABLE, f"its record cannot be written: {error}; the engine "
                    "is still supervised and the write is retried")
        owner._throttled.warning(f"storage:{owner.name}", "record of %s not written: %s",
                                 owner.name, error)
    if not owner._persist_pending:
        owner._persist_pending = True
        asyncio.get_running_loop().call_later(owner._persist_retry_s, owner._inbox.put_nowait,
                                              PersistDue())
        owner._persist_retry_s = min(MAX_RETRY_S, owner._persist_retry_s * 2)


def write_succeeded(owner: EngineOwner) -> None:
    if owner._deps.storage.failing.pop(owner.record.engine_id, None) is not None:
        owner._emit("StorageRecovered", "its record is written again")


async def on_persist_due(owner: EngineOwner) -> None:
    owner._persist_pending = False
    if owner.record.engine_id in owner._deps.storage.failing:
        await owner._persist()


async def stop_is_durable(owner: EngineOwner) -> bool:
    """Write the record as STOPPING, or remove it, or remember the stop beside the KV segments
    (a read-only state directory), before anything is stopped: a stop nothing remembers would
    be undone by the next agent (it restarts what it finds recorded)."""
    record = owner.record
    stopping = record.model_copy(deep=True, update={"phase": Phase.STOPPING})
    try:
        await asyncio.to_thread(owner._deps.store.save, stopping)
        return True
    except OSError as exc:
        write_failed(owner, exc)
    try:  # unlink works on a full disk, where a write does not
        await asyncio.to_thread(owner._deps.store.delete, record.engine_id)
        return True
    except OSError:
        pass
    settings = owner._settings
    try:
        where = await asyncio.to_thread(stops.mark, settings.kv_shm_dir, str(settings.state_dir),
                                        record.engine_id)
    except OSError:
        return False
    owner._emit(STORAGE_UNAVAILABLE, f"its record cannot be changed; the stop is remembered in "
                f"{where}, so a restarted agent finishes it instead of starting the engine again")
    return True
