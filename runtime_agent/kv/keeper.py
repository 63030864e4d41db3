"""The part of an engine's owner that keeps its KV-cache limit: segment I/O around ``kv_hold``.

It belongs to one owner and is only called from the owner's task, so it needs no lock. Every
segment read and write is blocking flock I/O and runs in a worker thread. The watch helper
looks for the segment every few milliseconds until it appears (so an initial limit is in force
within milliseconds of the engine creating it), then reads it on the hold interval; it waits on
the owner's injected clock (``contract.clock``). It writes
to the segment, and removes it, only while the agent still holds the segment's name (the claim
marker its record names, ``runtime_agent.kv.ownership``): never another's engine's.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace

from contract.clock import Clock, LoopClock
from contract.reasons import KV_SEGMENT_MISSING
from runtime_agent.cadence import Pacer
from runtime_agent.kv.hold import (
    KvState,
    Write,
    after_write,
    new_process,
    on_reading,
    with_request,
)
from runtime_agent.kv.ownership import holds, release
from runtime_agent.kv.segment import (
    SegmentError,
    SegmentInfo,
    SegmentMissing,
    SegmentReplaced,
    clamp,
    read_segment,
    read_segment_nowait,
    remove_segment,
    segment_path,
    write_limit,
)
from runtime_agent.loops import Throttled

if TYPE_CHECKING:
    from registry.record import EngineRecord

log = logging.getLogger(__name__)
_throttled = Throttled(log)  # a segment that stays unreadable is reported once per interval
_COARSE_CLOCK_S = 0.01
_EVENT_REASONS = {"initial": "KVLimitSet", "requested": "KVLimitSet",
                  "restored": "KVLimitRestored", "set_back": "KVLimitSetBack"}


class KvKeeper:
    def __init__(self, record: EngineRecord, shm_dir: Path,
                 emit: Callable[[str, str], None],
                 writer: Callable[..., SegmentInfo] = write_limit,
                 clock: Clock | None = None) -> None:
        self._record = record
        self._clock = clock or LoopClock()  # the owner's: it waits on it between looks
        self._writer = writer  # the segment write that returns its read-back
        self.writes = 0  # the agent's own writes finished: readings from before one are stale
        self._ipc = record.spec.ipc_name
        self._shm_dir = shm_dir
        self._emit = emit
        self._spawned_at: float | None = None  # unknown for an adopted engine
        target = None
        if record.kv_limit_bytes is not None and record.kv_capacity_bytes is not None:
            target = clamp(record.kv_limit_bytes, record.kv_capacity_bytes)[0]
        self.state = KvState(requested=record.kv_limit_bytes, target=target,
                             capacity=record.kv_capacity_bytes, inode=record.kv_inode,
                             applied=record.kv_applied_bytes)

    async def watch(self, post: Callable[[SegmentInfo | None, int], None], first_s: float,
                    hold: Pacer, ready: Callable[[], bool] = lambda: False) -> None:
        """Post a reading (and how many writes the agent had finished before taking it) when
        the segment appears, then as ``hold`` paces it (its floor is the hold interval; a
        reading other than the last, its use moving say, is an event, and steady readings
        back off); ``None`` when a segment seen is gone. The segment is looked for every
        ``first_s`` while the engine boots (it creates it as it sizes its KV cache, and a
        limit must be in force before the cache fills); once the engine is ``ready`` without
        one (Ollama, a vLLM without kvcached), as ``hold`` paces it: a hundred looks a second
        for the engine's whole life would cost each such engine a little CPU for nothing."""
        path = self._shm_dir / self._ipc
        last: SegmentInfo | None = None
        while True:
            if not os.path.exists(path):  # a stat on tmpfs: microseconds, fine on the loop
                if self.state.present or self.state.inode is not None:
                    post(None, self.writes)  # it was there: deleted under the engine
                if ready():
                    hold.looked(event=last is not None)
                    last = None
                    await hold.pause()
                else:
                    await self._clock.sleep(first_s)
                continue
            writes = self.writes
            try:
                try:
                    info = read_segment_nowait(self._ipc, self._shm_dir)
                except BlockingIOError:  # a writer holds the lock: wait for it off the loop
                    info = await asyncio.to_thread(read_segment, self._ipc, self._shm_dir)
            except SegmentError as exc:
                _throttled.warning(f"kv-read:{self._ipc}", "kv segment of %s unreadable: %s",
                                   self._record.spec.model_name, exc)
                info = None
            if info is None or on_reading(self.state, info) != (self.state, None):
                post(info, writes)  # a reading that would change nothing spares the owner
            if info is None:  # unreadable: look again soon
                await self._clock.sleep(first_s)
                continue
            hold.looked(event=info != last)
            last = info
            await hold.pause()

    async def reading(self, info: SegmentInfo | None, writes: int | None = None) -> bool:
        """Handle one reading; True when the record changed and must be persisted. A reading
        taken before one of the agent's own writes finished is stale: it would pass the old
        value for someone else's write."""
        if writes is not None and writes != self.writes:
            return False
        before = self._durable()
        was_lost = self.state.lost
        self.state, write = on_reading(self.state, info)
        if self.state.lost and not was_lost:
            log.warning("kv segment %s of %s vanished under the running engine: no KV limit is "
                        "in force until the engine creates a new one", self._ipc,
                        self._record.spec.model_name)
            self._emit(KV_SEGMENT_MISSING, f"segment {self._ipc} is gone; the limit is applied "
                       "again when the engine recreates it")
        if write is not None:
            await self._write(write)
        return self._durable() != before

    def _durable(self) -> tuple[int | None, int | None, int | None]:
        return self.state.capacity, self.state.inode, self.state.applied

    async def request(self, limit: int) -> dict[str, Any]:
        """Set the limit the controller asked for (0: lift it back to the engine's capacity,
        as kvcached reads a limit of 0); what the answer reports about it."""
        if limit == 0:
            return await self._lift()
        self._record.kv_limit_bytes = limit
        self.state, write, clamped = with_request(self.state, limit)
        if write is not None:
            await self._write(write)
        st = self.state
        applied = st.target is not None and st.applied == st.target
        if not st.present and st.lost:
            message = ("the engine's KV segment is gone (deleted under the running engine); "
                       "the limit is applied the moment the engine recreates it")
        elif not st.present:
            message = ("the engine has not created its KV segment yet; the limit is applied "
                       "the moment it does")
        elif clamped:
            message = (f"{limit} bytes is above the {st.capacity} bytes the engine started "
                       f"with; clamped to {st.target}, the whole KV cache: the limit asked is "
                       "in force (kv_capacity_bytes reports it)")
        elif applied:
            message = "the segment holds the limit"
        else:
            message = "the segment did not take the limit; see the agent log"
        if applied and st.used is not None and st.target is not None and st.used > st.target:
            message += (f"; {st.used} bytes are in use, above the limit: kvcached frees "
                        "nothing, use drops as requests finish")
        self._record.count_operation("kv_limit", "applied" if applied else
                                     ("pending" if not st.present else "failed"))
        return {"in_force": applied, "requested_bytes": limit, "applied_bytes": st.applied,
                "clamped": clamped, "capacity_bytes": st.capacity, "used_bytes": st.used,
                "message": message}

    async def _lift(self) -> dict[str, Any]:
        capacity = self.state.capacity
        if capacity is not None and self.state.present:
            detail = await self.request(capacity)
        else:
            detail = {"in_force": True, "applied_bytes": self.state.applied, "clamped": False,
                      "capacity_bytes": capacity, "used_bytes": self.state.used}
        self._record.kv_limit_bytes = None
        self.state = replace(self.state, requested=None, target=None)
        return {**detail, "requested_bytes": 0,
                "message": "no limit: the engine may use its whole KV capacity"}

    async def _write(self, write: Write) -> None:
        try:
            await self._write_once(write)
        finally:
            self.writes += 1  # whatever came of it, readings taken before it are stale

    def _holds(self) -> bool:
        """The name is still this agent's (a stat on tmpfs: microseconds, fine on the loop)."""
        record = self._record
        if holds(self._ipc, self._shm_dir, record.kv_owner_inode, record.engine_id):
            return True
        _throttled.warning(f"kv-owner:{self._ipc}", "kv segment %s of %s is no longer claimed "
                           "by this agent (its claim marker is gone or another's): it is "
                           "neither written nor removed", self._ipc,
                           self._record.spec.model_name)
        return False

    async def _write_once(self, write: Write) -> None:
        if not self._holds():
            return
        try:
            readback = await asyncio.to_thread(self._writer, self._ipc, write.value,
                                               self._shm_dir, write.expected_inode)
        except SegmentReplaced:
            return  # the engine restarted: the next reading sees the new segment
        except SegmentMissing:
            self.state = replace(self.state, present=False)
            return
        except (SegmentError, OSError) as exc:
            log.warning("kv limit write for %s failed: %s", self._record.spec.model_name, exc)
            self._record.count_operation("kv_limit", "failed")
            return
        self.state = after_write(self.state, write, readback)
        held = self.state.applied == write.value
        if write.reason == "set_back":
            self._record.count_operation("kv_limit", "set_back")
        elif write.reason == "restored":
            self._record.count_operation("kv_limit", "restored")
        self._emit(_EVENT_REASONS[write.reason] if held else "KVLimitNotHeld",
                   f"{write.value} bytes ({write.reason}); segment holds {readback.total_size}, "
                   f"uses {readback.mapped}")

    async def remove_leftover(self, release_name: bool = False) -> None:
        """The engine is gone: remove its segment (kvcached leaves it behind on SIGKILL), but
        only one its engine made: the inode this agent saw it create, or, when the engine died
        before a reading, a segment of that name made after the engine was spawned (the claim
        proved none was there before the first start). Nothing is removed once the name is no
        longer this agent's. ``release_name``: the engine is stopped for good; the claim
        marker goes too."""
        if not self._holds():
            self.state = replace(self.state, present=False, used=None, total=None, applied=None)
            return
        await self._remove_ours()
        if release_name:
            await asyncio.to_thread(release, self._ipc, self._shm_dir,
                                    self._record.kv_owner_inode)

    async def _remove_ours(self) -> None:
        inode = self.state.inode
        if inode is None and self._spawned_at is not None:
            inode = await asyncio.to_thread(self._made_since, self._spawned_at)
        if inode is None:
            self.state = replace(self.state, present=False, used=None, total=None, applied=None)
            return
        try:
            await asyncio.to_thread(remove_segment, self._ipc, self._shm_dir, inode)
        except (SegmentError, OSError) as exc:
            log.warning("could not remove kv segment of %s: %s", self._record.spec.model_name,
                        exc)
        self.state = replace(self.state, present=False, used=None, total=None, applied=None)

    def _made_since(self, since: float) -> int | None:
        try:
            st = os.stat(segment_path(self._ipc, self._shm_dir), follow_symlinks=False)
        except OSError:
            return None
        # file times come from the kernel's coarse clock, up to a tick behind time.time()
        return st.st_ino if st.st_ctime >= since - _COARSE_CLOCK_S else None

    def new_process(self, spawned_at: float | None = None) -> None:
        """A new engine process, spawned at ``spawned_at`` (wall clock, read before the spawn)."""
        self._spawned_at = spawned_at
        self.state = new_process(self.state)

    def persist_into(self, record: EngineRecord) -> None:
        record.kv_capacity_bytes = self.state.capacity
        record.kv_inode = self.state.inode
        record.kv_applied_bytes = self.state.applied
