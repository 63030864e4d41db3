"""kvcached's shared-memory KV segment: read it, set its limit, remove it.

A kvcached-enabled engine creates ``<shm_dir>/<ipc_name>`` (``/dev/shm`` in production) after it has
loaded its model: exactly 24 bytes, three native-endian int64 fields ``total_size`` (the KV-cache
limit in force), ``used_size`` and ``prealloc_size``. Everyone serialises through ``flock`` on the
file: readers hold ``LOCK_SH``, writers ``LOCK_EX``. The agent writes ``total_size`` only (a
read-modify-write under the exclusive lock) and the engine applies a new limit lazily.

The rules this module enforces, because kvcached itself does not (see ``design.md``):

* the agent never creates a segment: ``write_limit`` opens without ``O_CREAT`` and refuses a missing
  one (kvcached's own update function would create a stray segment for an unknown name);
* every write is read back under the same exclusive lock, so the caller learns what the segment
  really holds;
* an inode that differs from the one the caller saw is an engine restart (``SegmentReplaced``), and
  nothing is written to the new segment on the strength of the old one;
* a limit is clamped to the capacity the engine announced at start-up (``clamp``).

Everything here is blocking file I/O; the agent calls it from a worker thread, never on the event
loop. When kvcached's Python package is importable (the GPU image) and the segment lives in kvcached's
own ``SHM_DIR``, the three fields are read and written through kvcached's
``kvcached.cli.utils.get_kv_cache_limit`` / ``update_kv_cache_limit`` (behind the existence and
inode checks above); otherwise the built-in implementation below speaks the same protocol.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import importlib
import os
import struct
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from msgspec import Struct

from contract.names import ipc_name_problem

DEFAULT_SHM_DIR = "/dev/shm"
SEGMENT_FORMAT = "=qqq"  # native byte order, standard sizes: three int64 (kvcached uses numpy int64)
SEGMENT_SIZE = struct.calcsize(SEGMENT_FORMAT)  # 24
_TOTAL_FORMAT = "=q"  # total_size is the first field, at offset 0
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
# Environment switch, for operators and tests: "builtin" never touches kvcached's package.
BACKEND_ENV = "RUNTIME_AGENT_KV_SEGMENT_BACKEND"
_KVCACHED_MODULE = "kvcached.cli.utils"


class SegmentError(Exception):
    """A KV segment cannot be used as it is; the base of every error raised here."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class SegmentMalformed(SegmentError):
    """The file exists but is not a 24-byte segment (``size`` bytes instead)."""

    def __init__(self, path: str, size: int) -> None:
        super().__init__(f"KV segment {path} is {size} bytes long, expected {SEGMENT_SIZE}", path)
        self.size = size


class SegmentMissing(SegmentError):
    """There is no segment to write to: the engine has not created it (yet) or has removed it."""

    def __init__(self, path: str) -> None:
        super().__init__(f"KV segment {path} does not exist", path)


class SegmentReplaced(SegmentError):
    """The segment is not the one the caller knew (another inode): the engine restarted."""

    def __init__(self, path: str, expected_inode: int, actual_inode: int) -> None:
        super().__init__(
            f"KV segment {path} was replaced (inode {actual_inode}, expected {expected_inode}): the engine restarted",
            path,
        )
        self.expected_inode = expected_inode
        self.actual_inode = actual_inode


class SegmentInfo(Struct, frozen=True):
    """One consistent reading of a segment (taken under its lock) and the inode it was read from."""

    total_size: int
    used_size: int
    prealloc_size: int
    inode: int

    @property
    def mapped(self) -> int:
        """Bytes of KV memory the engine has mapped: in use plus pre-allocated."""
        return self.used_size + self.prealloc_size


# --- pure helpers -----------------------------------------------------------------------------------


def pack(total_size: int, used_size: int, prealloc_size: int) -> bytes:
    """The 24 bytes of a segment holding these three fields."""
    return struct.pack(SEGMENT_FORMAT, total_size, used_size, prealloc_size)


def unpack(data: bytes) -> tuple[int, int, int]:
    """``(total_size, used_size, prealloc_size)`` from exactly 24 bytes."""
    total, used, prealloc = struct.unpack(SEGMENT_FORMAT, data)
    return int(total), int(used), int(prealloc)


def clamp(limit: int, capacity: int) -> tuple[int, bool]:
    """``(min(limit, capacity), whether limit was lowered)``: never promise more than the engine has."""
    if limit > capacity:
        return capacity, True
    return limit, False


def segment_path(ipc_name: str, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> str:
    """``<shm_dir>/<ipc_name>``; the name must already be kvcached-normalised (no path tricks)."""
    problem = ipc_name_problem(ipc_name)
    if problem is not None:
        raise ValueError(problem)
    return os.path.join(os.fspath(shm_dir), ipc_name)


# --- backends ---------------------------------------------------------------------------------------


class _Backend(Protocol):
    """How the three fields are read and the limit written, once the checks here have passed."""

    name: str

    def read(self, fd: int, path: str, ipc_name: str) -> tuple[int, int, int] | None:
        """The fields of the open segment ``fd`` (``None`` if it vanished meanwhile)."""

    def update_total(self, fd: int, path: str, ipc_name: str, limit: int) -> tuple[int, int, int]:
        """Set ``total_size`` of the open segment ``fd``; return the fields it holds afterwards."""


LOCK_WAIT_S = 5.0


class SegmentBusy(SegmentError):
    """Another process held the segment's lock for longer than the agent waits (a stopped or
    hung engine mid-update): the call answers instead of waiting for ever."""

    def __init__(self, path: str, waited_s: float) -> None:
        super().__init__(f"KV segment {path} stayed locked by another process for "
                         f"{waited_s:g} s", path)


def _flock_bounded(fd: int, op: int, path: str, wait_s: float = LOCK_WAIT_S) -> None:
    """``flock`` that gives up once its pauses add up to ``wait_s`` (blocking: called in a
    worker thread, where no clock of the loop's can drive the wait, so it counts what it slept
    instead of reading the time)."""
    pause, waited = 0.001, 0.0
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if waited >= wait_s:
                raise SegmentBusy(path, wait_s) from None
            time.sleep(pause)
            waited += pause
            pause = min(0.05, pause * 2)


def _check_size(fd: int, path: str) -> os.stat_result:
    st = os.fstat(fd)
    if st.st_size != SEGMENT_SIZE:
        raise SegmentMalformed(path, st.st_size)
    return st


def _pread_fields(fd: int, path: str) -> tuple[int, int, int]:
    data = os.pread(fd, SEGMENT_SIZE, 0)
    if len(data) != SEGMENT_SIZE:
        raise SegmentMalformed(path, len(data))
    return unpack(data)


class _BuiltinBackend:
    """The protocol spoken directly: ``flock`` plus ``pread``/``pwrite`` on the caller's descriptor."""

    name = "builtin"

    def read(self, fd: int, path: str, ipc_name: str) -> tuple[int, int, int] | None:
        _flock_bounded(fd, fcntl.LOCK_SH, path)
        try:
            _check_size(fd, path)
            return _pread_fields(fd, path)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def update_total(self, fd: int, path: str, ipc_name: str, limit: int) -> tuple[int, int, int]:
        _flock_bounded(fd, fcntl.LOCK_EX, path)
        try:
            st = _check_size(fd, path)
            _check_still_linked(fd, path, st.st_ino)
            # Read-modify-write of total_size: used/prealloc are read under this lock and never written
            # (only the first 8 bytes are), so an engine's concurrent bookkeeping cannot be clobbered.
            _pread_fields(fd, path)
            written = os.pwrite(fd, struct.pack(_TOTAL_FORMAT, limit), 0)
            if written != struct.calcsize(_TOTAL_FORMAT):
                raise OSError(errno.EIO, f"short write to KV segment {path}")
            return _pread_fields(fd, path)  # read back under the same exclusive lock
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


class _KvcachedBackend:
    """kvcached's own functions, called only for a segment that exists and is the expected one.

    ``get_kv_cache_limit(name)`` and ``update_kv_cache_limit(name, limit)`` resolve ``name`` against
    kvcached's ``SHM_DIR`` and take the same ``flock`` locks on their own descriptor, so the caller's
    descriptor must hold no lock while they run. ``update_kv_cache_limit`` creates a missing segment;
    the existence check before the call and the inode check after it keep that from going unnoticed.
    """

    name = "kvcached"

    def __init__(self, get: Callable[[str], Any], update: Callable[[str, int], Any]) -> None:
        self._get = get
        self._update = update

    def read(self, fd: int, path: str, ipc_name: str) -> tuple[int, int, int] | None:
        _check_size(fd, path)  # kvcached would fail to map a short file with an unrelated error
        info = self._get(ipc_name)
        if info is None:
            return None
        return int(info.total_size), int(info.used_size), int(info.prealloc_size)

    def update_total(self, fd: int, path: str, ipc_name: str, limit: int) -> tuple[int, int, int]:
        st = _check_size(fd, path)
        _check_still_linked(fd, path, st.st_ino)
        info = self._update(ipc_name, limit)
        # kvcached read-modify-wrote all three fields under its exclusive lock and returns what it
        # wrote: that is the read-back. It must have landed on our inode, not on a new engine's segment
        # nor on a stray segment that it created because ours vanished in between.
        _check_still_linked(fd, path, st.st_ino)
        if info is None:
            raise SegmentMissing(path)
        return int(info.total_size), int(info.used_size), int(info.prealloc_size)


_BUILTIN = _BuiltinBackend()


@functools.lru_cache(maxsize=1)
def _kvcached_api() -> tuple[Callable[[str], Any], Callable[[str, int], Any], str] | None:
    """kvcached's read and update functions and its SHM_DIR, or None when kvcached is not usable."""
    try:
        with warnings.catch_warnings():  # kvcached warns at import when its autopatch .pth is absent
            warnings.simplefilter("ignore")
            module = importlib.import_module(_KVCACHED_MODULE)
    except Exception:  # not installed, or its import (torch, CUDA) failed: speak the protocol ourselves
        return None
    get = getattr(module, "get_kv_cache_limit", None)
    update = getattr(module, "update_kv_cache_limit", None)
    struct_type = getattr(module, "MemInfoStruct", None)
    # Older kvcached releases had a two-field segment; only the three-field layout is the protocol.
    if not callable(get) or not callable(update) or getattr(struct_type, "SHM_SIZE", None) != SEGMENT_SIZE:
        return None
    shm_dir = getattr(module, "SHM_DIR", DEFAULT_SHM_DIR)
    if not isinstance(shm_dir, str):
        return None
    return get, update, shm_dir


def reset_backend_cache() -> None:
    """Forget whether kvcached is importable (tests install and remove a reference module)."""
    _kvcached_api.cache_clear()


def _backend_for(shm_dir: str | os.PathLike[str]) -> _Backend:
    if os.environ.get(BACKEND_ENV, "").strip().lower() == "builtin":
        return _BUILTIN
    api = _kvcached_api()
    if api is None:
        return _BUILTIN
    get, update, kvcached_dir = api
    # kvcached's functions only know their own directory; any other directory is ours to handle.
    if os.path.realpath(os.fspath(shm_dir)) != os.path.realpath(kvcached_dir):
        return _BUILTIN
    return _KvcachedBackend(get, update)


def backend_name(shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> str:
    """``"kvcached"`` or ``"builtin"``: which implementation serves segments in ``shm_dir``."""
    return _backend_for(shm_dir).name


# --- public operations ------------------------------------------------------------------------------


def _check_still_linked(fd: int, path: str, inode: int) -> None:
    """Raise unless ``path`` still names the inode open as ``fd``."""
    try:
        current = os.stat(path).st_ino
    except FileNotFoundError:
        raise SegmentMissing(path) from None
    if current != inode or os.fstat(fd).st_nlink == 0:
        raise SegmentReplaced(path, inode, current)


def _open_existing(path: str, flags: int) -> int | None:
    try:
        return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None


def read_segment(ipc_name: str, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> SegmentInfo | None:
    """The segment's fields under a shared lock, or None when there is no segment.

    Raises ``SegmentMalformed`` for a file that is not 24 bytes long.
    """
    path = segment_path(ipc_name, shm_dir)
    backend = _backend_for(shm_dir)
    for _attempt in range(3):
        fd = _open_existing(path, os.O_RDONLY)
        if fd is None:
            return None
        try:
            inode = os.fstat(fd).st_ino
            fields = backend.read(fd, path, ipc_name)
            if fields is None:
                return None
            if backend is _BUILTIN:
                return SegmentInfo(*fields, inode=inode)
            try:  # kvcached opened the path itself: make sure it read the inode we report
                _check_still_linked(fd, path, inode)
            except SegmentMissing:
                return None
            except SegmentReplaced:
                continue
            return SegmentInfo(*fields, inode=inode)
        finally:
            os.close(fd)
    raise SegmentError(f"KV segment {path} kept being replaced while it was read", path)


def read_segment_nowait(ipc_name: str, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR
                        ) -> SegmentInfo | None:
    """``read_segment`` that never blocks: BlockingIOError while a writer holds the lock.

    The segment lives on tmpfs, so open, flock and pread take microseconds; only a held lock
    could block. The agent tries this on its event loop and falls back to ``read_segment`` in
    a worker thread when it raises, which saves a thread hop per engine per hold interval.
    """
    path = segment_path(ipc_name, shm_dir)
    fd = _open_existing(path, os.O_RDONLY)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        try:
            st = _check_size(fd, path)
            return SegmentInfo(*_pread_fields(fd, path), inode=st.st_ino)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def write_limit(
    ipc_name: str,
    limit_bytes: int,
    shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
    expected_inode: int | None = None,
) -> SegmentInfo:
    """Set the segment's ``total_size`` to ``limit_bytes``; return what the segment holds afterwards.

    Never creates a segment: a missing one raises ``SegmentMissing``. With ``expected_inode`` a segment
    with another inode raises ``SegmentReplaced`` and is left untouched. ``used_size`` and
    ``prealloc_size`` are kept as they are. The caller clamps ``limit_bytes`` (see ``clamp``) first.
    """
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int):
        raise TypeError(f"limit_bytes must be an int, not {type(limit_bytes).__name__}")
    if limit_bytes <= 0:
        raise ValueError(f"a KV limit must be positive, got {limit_bytes}")
    if limit_bytes > _INT64_MAX:
        raise ValueError(f"a KV limit must fit in int64, got {limit_bytes}")
    path = segment_path(ipc_name, shm_dir)
    backend = _backend_for(shm_dir)
    fd = _open_existing(path, os.O_RDWR)  # no O_CREAT, ever
    if fd is None:
        raise SegmentMissing(path)
    try:
        inode = os.fstat(fd).st_ino
        if expected_inode is not None and inode != expected_inode:
            raise SegmentReplaced(path, expected_inode, inode)
        fields = backend.update_total(fd, path, ipc_name, limit_bytes)
        return SegmentInfo(*fields, inode=inode)
    finally:
        os.close(fd)


def remove_segment(
    ipc_name: str, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR, expected_inode: int | None = None
) -> bool:
    """Unlink a leftover segment (an engine killed with SIGKILL cannot); True if one was removed.

    With ``expected_inode`` a segment with another inode (a newer engine's) is left alone.
    """
    path = segment_path(ipc_name, shm_dir)
    try:
        if expected_inode is not None and os.stat(path, follow_symlinks=False).st_ino != expected_inode:
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def create_segment(
    ipc_name: str,
    total_size: int,
    shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
    used_size: int = 0,
    prealloc_size: int = 0,
) -> SegmentInfo:
    """Create (or reset) a segment the way an engine does at start-up: a fresh inode, atomically.

    Engines own their segments; the agent never calls this. It exists for tests and tools.
    """
    path = segment_path(ipc_name, shm_dir)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        os.write(fd, pack(total_size, used_size, prealloc_size))
        inode = os.fstat(fd).st_ino
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    os.close(fd)
    return SegmentInfo(total_size, used_size, prealloc_size, inode)


def segment_exists(ipc_name: str, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> bool:
    """Whether a file of that name is there (without judging its contents)."""
    return Path(segment_path(ipc_name, shm_dir)).exists()
