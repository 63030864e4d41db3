"""An owner's record writer: a write that fails is retried on the owner's clock, never fatal.

A full (ENOSPC), read-only (EROFS) or failing (EIO) state directory must not end an engine's
owner: it keeps supervising, reports the condition (``StorageUnavailable`` in the view, the
shared ``StorageHealth`` behind ``/healthz``), and writes again after a growing pause until a
write succeeds. The pause is a timer on the injected clock that posts ``PersistDue`` to the
owner's inbox. A stop that cannot be written is remembered beside the KV segments instead
(``registry.stops``): see ``stop_is_durable``.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import TYPE_CHECKING

from msgspec.structs import replace

from contract.phases import Phase
from contract.reasons import STORAGE_UNAVAILABLE
from registry import stops
from registry.store import RegistryStore
from runtime_agent.loops import Throttled
from runtime_agent.supervision.durability import StorageHealth
from runtime_agent.supervision.messages import PersistDue
from runtime_agent.supervision.owner.port import OwnerLoop, Posted

if TYPE_CHECKING:
    from registry.record import EngineRecord

FIRST_RETRY_S = 0.5
MAX_RETRY_S = 30.0


class RecordWriter:
    def __init__(self, loop: OwnerLoop, store: RegistryStore, storage: StorageHealth,
                 throttled: Throttled) -> None:
        self._loop, self._store, self._storage, self._throttled = loop, store, storage, throttled
        self._pending = False  # a retry of a failed write is scheduled
        self._retry_s = 0.0

    async def write(self, snapshot: EngineRecord) -> bool:
        """Write ``snapshot`` (fsync: off the event loop); False when the disk refused it."""
        try:
            await asyncio.to_thread(self._store.save, snapshot)
        except OSError as exc:
            self._failed(exc)
            return False
        if self._storage.failing.pop(snapshot.engine_id, None) is not None:
            self._loop.emit("StorageRecovered", "its record is written again")
        return True

    def due(self) -> bool:
        """The retry's time came: whether a write is still owed."""
        self._pending = False
        return self._loop.record.engine_id in self._storage.failing

    def _failed(self, exc: OSError) -> None:
        """Say so once, keep supervising, try again later."""
        loop = self._loop
        error = f"{exc.strerror or exc} ({exc.__class__.__name__}, errno {exc.errno})"
        first = loop.record.engine_id not in self._storage.failing
        self._storage.failing[loop.record.engine_id] = error
        if first:
            self._retry_s = FIRST_RETRY_S
            loop.emit(STORAGE_UNAVAILABLE, f"its record cannot be written: {error}; the engine "
                      "is still supervised and the write is retried")
            self._throttled.warning(f"storage:{loop.name}", "record of %s not written: %s",
                                    loop.name, error)
        if not self._pending:
            self._pending = True
            loop.clock.later(self._retry_s, Posted(PersistDue(), loop.post))
            self._retry_s = min(MAX_RETRY_S, self._retry_s * 2)

    async def stop_is_durable(self, kv_shm_dir: Path, state_dir: str) -> bool:
        """Write the record as STOPPING, or remove it, or remember the stop beside the KV
        segments (a read-only state directory), before anything is stopped: a stop nothing
        remembers would be undone by the next agent (it restarts what it finds recorded)."""
        record = self._loop.record
        stopping = replace(copy.deepcopy(record), phase=Phase.STOPPING)
        try:
            await asyncio.to_thread(self._store.save, stopping)
            return True
        except OSError as exc:
            self._failed(exc)
        try:  # unlink works on a full disk, where a write does not
            await asyncio.to_thread(self._store.delete, record.engine_id)
            return True
        except OSError:
            pass
        try:
            where = await asyncio.to_thread(stops.mark, kv_shm_dir, state_dir, record.engine_id)
        except OSError:
            return False
        self._loop.emit(STORAGE_UNAVAILABLE, f"its record cannot be changed; the stop is "
                        f"remembered in {where}, so a restarted agent finishes it instead of "
                        "starting the engine again")
        return True
