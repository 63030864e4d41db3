"""kvcached inside the simulated engine: the shared-memory segment and the KV it accounts for.

A vLLM engine started with ``ENABLE_KVCACHED=true`` and ``KVCACHED_IPC_NAME`` creates
``/dev/shm/<name>`` once its model is loaded: 24 bytes, three native int64 (``total_size`` = the KV
limit, ``used_size``, ``prealloc_size``), guarded by ``flock`` on the file. The agent lowers or raises
``total_size``; the engine picks the new limit up lazily (on its next allocation and from a 100 ms
watch), ignores 0, never frees live KV when the limit drops (requests simply wait for room), and
resets the segment when it restarts; a segment deleted under it is created again, zero-filled, on
its next update of ``used_size`` (as kvcached's write path does). This module reproduces that
behaviour with its own code, on purpose independent of the agent's ``runtime_agent.kv.segment``,
so tests exercise the protocol between two implementations. ``KVCACHED_SHM_DIR`` (ours, not kvcached's) moves the segment for tests.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import struct
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any

from engines.sim import logs

SEGMENT_FORMAT = "=qqq"  # total_size, used_size, prealloc_size
SEGMENT_SIZE = struct.calcsize(SEGMENT_FORMAT)
USED_OFFSET = 8  # used_size is the second int64
DEFAULT_SHM_DIR = "/dev/shm"
WATCH_INTERVAL_S = 0.1
_TRUE = ("true", "1")


def sanitize_ipc_name(name: str) -> str:
    """kvcached's normalisation: characters outside [A-Za-z0-9_-] become '-', at most 64 characters."""
    return "".join(ch if (ch.isascii() and ch.isalnum()) or ch in "_-" else "-" for ch in name)[:64]


def ipc_name_from_env(env: Mapping[str, str]) -> str | None:
    """The segment name when the environment enables kvcached with an explicit name, else None."""
    if env.get("ENABLE_KVCACHED", "false").strip().lower() not in _TRUE:
        return None
    raw = env.get("KVCACHED_IPC_NAME", "").strip()
    return sanitize_ipc_name(raw) or None


def round_up_to_pages(nbytes: int, page_bytes: int, layers: int) -> int:
    """KV is mapped in whole pages on every layer: round ``nbytes`` up to a multiple of page*layers."""
    unit = page_bytes * layers
    return -(-nbytes // unit) * unit if nbytes > 0 else 0


class KvCache:
    """The segment of one engine, its limit in force and the KV its running requests hold."""

    def __init__(self, ipc_name: str, shm_dir: str, capacity: int, request_bytes: int) -> None:
        self.ipc_name = ipc_name
        self.path = os.path.join(shm_dir, ipc_name)
        self.capacity = capacity
        self.request_bytes = request_bytes
        self.limit = capacity  # the limit in force (what the engine last applied)
        self.used = 0
        self.inode: int | None = None
        self._changed = asyncio.Condition()
        self._queue: deque[object] = deque()  # requests waiting for KV, first come first served
        self._watch: asyncio.Task[None] | None = None
        self.used_changed: Callable[[], None] = lambda: None  # the GPU report follows ``used``

    # --- the segment file ---------------------------------------------------------------------------

    def create(self) -> None:
        """Create the segment at full capacity; an existing one (a previous life) is replaced."""
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            os.fchmod(fd, 0o666)  # the agent may run as another user, as with kvcached's segments
            os.write(fd, struct.pack(SEGMENT_FORMAT, self.capacity, 0, 0))
            self.inode = os.fstat(fd).st_ino
            os.replace(tmp, self.path)  # a new inode: readers can tell a restart from a limit change
        except BaseException:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        self.limit = self.capacity
        self.used = 0
        logs.engine_log("INFO", f"kvcached: KV segment {self.path} created with limit {self.capacity} bytes.",
                        "mem_info_tracker.py")

    def remove(self) -> bool:
        """Unlink the segment if it is still ours (clean shutdown); True if it was removed."""
        if self.inode is None:
            return False
        try:
            if os.stat(self.path).st_ino != self.inode:
                return False
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        self.inode = None  # gone for good: a request finishing after this recreates nothing
        logs.engine_log("INFO", f"kvcached: KV segment {self.path} removed.", "mem_info_tracker.py")
        return True

    def _open_ours(self, flags: int) -> int | None:
        """The segment, opened without ever creating it, if the path still names our inode."""
        try:
            fd = os.open(self.path, flags | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        if os.fstat(fd).st_ino != self.inode:
            os.close(fd)
            return None
        return fd

    def read_total(self) -> int | None:
        """``total_size`` under a shared lock; None when the segment is gone, foreign or malformed."""
        fd = self._open_ours(os.O_RDONLY)
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            data = os.pread(fd, SEGMENT_SIZE, 0)
        finally:
            os.close(fd)  # closing the descriptor releases the lock
        if len(data) != SEGMENT_SIZE:
            return None
        total, _used, _prealloc = struct.unpack(SEGMENT_FORMAT, data)
        return int(total)

    def _recreate(self) -> int | None:
        """kvcached's write path (``RwLockedShm`` with a write lock) on a deleted segment: it
        creates the file again, zero-filled, so its ``total_size`` reads 0 (which the engine
        ignores: it keeps the limit it had). None if another file took the name."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            return None
        os.fchmod(fd, 0o666)
        os.ftruncate(fd, SEGMENT_SIZE)
        self.inode = os.fstat(fd).st_ino
        logs.engine_log("WARNING", f"kvcached: KV segment {self.path} was missing; created it "
                        "again with limit 0.", "mem_info_tracker.py")
        return fd

    def _publish_used(self) -> None:
        """Write ``used_size`` (and nothing else) under the exclusive lock."""
        fd = self._open_ours(os.O_RDWR)
        if fd is None and self.inode is not None and not os.path.lexists(self.path):
            fd = self._recreate()
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size >= SEGMENT_SIZE:
                os.pwrite(fd, struct.pack("=q", self.used), USED_OFFSET)
        finally:
            os.close(fd)

    # --- the limit ----------------------------------------------------------------------------------

    def refresh_limit(self) -> bool:
        """Apply the segment's ``total_size`` (0 is ignored); True if the limit in force changed."""
        total = self.read_total()
        if total is None or total <= 0:
            return False
        new_limit = min(total, self.capacity)  # the engine cannot hold more than it has
        if new_limit == self.limit:
            return False
        logs.engine_log("INFO", f"kvcached: KV limit changed from {self.limit} to {new_limit} bytes "
                        f"({self.used} bytes in use).", "kv_cache_manager.py")
        self.limit = new_limit
        return True

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _watch_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if self.refresh_limit():
                await self._notify()

    def start_watch(self, interval: float = WATCH_INTERVAL_S) -> None:
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_loop(interval))

    async def stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    # --- allocation ---------------------------------------------------------------------------------

    @asynccontextmanager
    async def allocation(self) -> AsyncIterator[None]:
        """Hold one request's KV for the body; wait (first come first served) until it fits."""
        need = self.request_bytes
        if need <= 0:
            yield
            return
        if self.refresh_limit():
            await self._notify()
        ticket = object()
        self._queue.append(ticket)
        try:
            async with self._changed:
                await self._changed.wait_for(lambda: self._queue[0] is ticket and self.used + need <= self.limit)
                self._queue.popleft()
                self.used += need
                self._changed.notify_all()  # the next in line may fit too
        except BaseException:
            if ticket in self._queue:
                self._queue.remove(ticket)
                await asyncio.shield(self._notify())
            raise
        self.used_changed()  # the GPU report before the segment: a reader of both never sees
        self._publish_used()  # the segment ahead of the memory it stands for
        try:
            yield
        finally:
            self.used -= need
            self.used_changed()
            self._publish_used()
            await asyncio.shield(self._notify())  # wake the next in line even if this task is cancelled

    def snapshot(self) -> dict[str, Any]:
        """The kv part of the /sim/state document."""
        return {
            "ipc_name": self.ipc_name,
            "path": self.path,
            "inode": self.inode,
            "capacity_bytes": self.capacity,
            "limit_bytes": self.limit,
            "used_bytes": self.used,
            "request_bytes": self.request_bytes,
            "waiting_for_kv": len(self._queue),
        }
