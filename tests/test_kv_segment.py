"""The kvcached segment protocol as the agent speaks it: read, set the limit, never create, spot restarts.

Every test works in its own temporary directory standing in for /dev/shm. The kvcached path is
checked against a small reference module that reproduces the shapes (and the stray-segment flaw) of
kvcached's ``kvcached.cli.utils``, since the real package needs a GPU to install.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import sys
import tempfile
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_agent.kv import segment as kv_segment
from runtime_agent.kv.segment import (
    SEGMENT_SIZE,
    SegmentError,
    SegmentInfo,
    SegmentMalformed,
    SegmentMissing,
    SegmentReplaced,
    backend_name,
    clamp,
    create_segment,
    pack,
    read_segment,
    remove_segment,
    unpack,
    write_limit,
)

pytestmark = pytest.mark.timeout(60)

MIB = 1024**2
GIB = 1024**3
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@pytest.fixture(autouse=True)
def fresh_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test decides afresh whether kvcached is importable (and never sees a real one by accident)."""
    monkeypatch.delenv(kv_segment.BACKEND_ENV, raising=False)
    kv_segment.reset_backend_cache()
    yield
    kv_segment.reset_backend_cache()


def raw(path: Path) -> bytes:
    return path.read_bytes()


# --- basics ---------------------------------------------------------------------------------------


def test_a_segment_reads_back_what_was_written(tmp_path: Path) -> None:
    created = create_segment("engine-a", 2 * GIB, tmp_path, used_size=64 * MIB, prealloc_size=4 * MIB)
    assert (tmp_path / "engine-a").stat().st_size == SEGMENT_SIZE == 24
    info = read_segment("engine-a", tmp_path)
    assert info == created == SegmentInfo(2 * GIB, 64 * MIB, 4 * MIB, (tmp_path / "engine-a").stat().st_ino)
    assert info.mapped == 68 * MIB
    written = write_limit("engine-a", GIB, tmp_path)
    assert written == SegmentInfo(GIB, 64 * MIB, 4 * MIB, info.inode)
    assert read_segment("engine-a", tmp_path) == written
    assert raw(tmp_path / "engine-a") == struct.pack("=qqq", GIB, 64 * MIB, 4 * MIB)


def test_reading_a_missing_segment_gives_none_and_creates_nothing(tmp_path: Path) -> None:
    assert read_segment("nobody", tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_write_limit_never_creates_a_missing_segment(tmp_path: Path) -> None:
    with pytest.raises(SegmentMissing) as caught:
        write_limit("nobody", GIB, tmp_path)
    assert caught.value.path == str(tmp_path / "nobody")
    with pytest.raises(SegmentMissing):
        write_limit("nobody", GIB, tmp_path, expected_inode=12345)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("size", [0, 8, 16, 23, 25, 32])
def test_a_file_of_the_wrong_size_is_refused_and_left_alone(tmp_path: Path, size: int) -> None:
    path = tmp_path / "odd"
    path.write_bytes(b"\x01" * size)
    with pytest.raises(SegmentMalformed) as caught:
        read_segment("odd", tmp_path)
    assert caught.value.size == size and isinstance(caught.value, SegmentError)
    with pytest.raises(SegmentMalformed):
        write_limit("odd", GIB, tmp_path)
    assert raw(path) == b"\x01" * size


def test_writing_the_limit_keeps_used_and_prealloc(tmp_path: Path) -> None:
    create_segment("busy", 8 * GIB, tmp_path, used_size=3 * GIB, prealloc_size=123)
    info = write_limit("busy", GIB, tmp_path)  # below what is in use: the engine keeps its live KV
    assert (info.total_size, info.used_size, info.prealloc_size) == (GIB, 3 * GIB, 123)
    info = write_limit("busy", 4 * GIB, tmp_path)
    assert (info.total_size, info.used_size, info.prealloc_size) == (4 * GIB, 3 * GIB, 123)


@pytest.mark.parametrize("limit", [0, -1, -(2**40)])
def test_a_limit_of_zero_or_less_is_refused_without_touching_the_segment(tmp_path: Path, limit: int) -> None:
    create_segment("e", GIB, tmp_path)
    before = raw(tmp_path / "e")
    with pytest.raises(ValueError):
        write_limit("e", limit, tmp_path)
    with pytest.raises(TypeError):
        write_limit("e", 1.5, tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        write_limit("e", 2**63, tmp_path)
    assert raw(tmp_path / "e") == before


def test_an_engine_restart_is_detected_by_its_new_inode(tmp_path: Path) -> None:
    old = create_segment("e", 2 * GIB, tmp_path)
    pin = os.open(tmp_path / "e", os.O_RDONLY)  # keeps the old inode number from being reused
    try:
        os.unlink(tmp_path / "e")
        new = create_segment("e", 2 * GIB, tmp_path, used_size=MIB)
        assert new.inode != old.inode
        with pytest.raises(SegmentReplaced) as caught:
            write_limit("e", GIB, tmp_path, expected_inode=old.inode)
        assert (caught.value.expected_inode, caught.value.actual_inode) == (old.inode, new.inode)
        assert read_segment("e", tmp_path) == new  # nothing was written to the new engine's segment
        assert write_limit("e", GIB, tmp_path, expected_inode=new.inode).total_size == GIB
    finally:
        os.close(pin)


def test_a_segment_replaced_by_rename_is_detected_too(tmp_path: Path) -> None:
    old = create_segment("e", 2 * GIB, tmp_path)
    new = create_segment("e", 2 * GIB, tmp_path)  # temp file renamed over the old one: a new inode
    assert new.inode != old.inode
    with pytest.raises(SegmentReplaced):
        write_limit("e", GIB, tmp_path, expected_inode=old.inode)
    assert read_segment("e", tmp_path) == new


def test_clamp_lowers_only_a_limit_above_the_capacity() -> None:
    assert clamp(3 * GIB, 2 * GIB) == (2 * GIB, True)
    assert clamp(2 * GIB, 2 * GIB) == (2 * GIB, False)
    assert clamp(GIB, 2 * GIB) == (GIB, False)


def test_remove_segment_reports_whether_it_removed_one(tmp_path: Path) -> None:
    info = create_segment("e", GIB, tmp_path)
    assert remove_segment("e", tmp_path, expected_inode=info.inode + 1) is False  # a newer engine's: kept
    assert (tmp_path / "e").exists()
    assert remove_segment("e", tmp_path, expected_inode=info.inode) is True
    assert remove_segment("e", tmp_path) is False
    create_segment("e", GIB, tmp_path)
    assert remove_segment("e", tmp_path) is True and not (tmp_path / "e").exists()


@pytest.mark.parametrize("name", ["", "../etc", "a/b", ".", "..", "x" * 65, "with space", "dot.name"])
def test_names_that_are_not_kvcached_ipc_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError):
        read_segment(name, tmp_path)
    with pytest.raises(ValueError):
        write_limit(name, GIB, tmp_path)
    with pytest.raises(ValueError):
        remove_segment(name, tmp_path)


def test_a_symlink_in_place_of_a_segment_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(pack(GIB, 0, 0))
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        write_limit("link", 1, tmp_path)
    assert raw(target) == pack(GIB, 0, 0)


# --- concurrency ----------------------------------------------------------------------------------


def test_concurrent_readers_and_writers_see_consistent_segments(tmp_path: Path) -> None:
    """Agents set limits while the engine updates used/prealloc in two steps: flock keeps both whole.

    The engine's bookkeeping keeps ``prealloc == 2 * used`` but writes the two fields separately (with a
    thread switch in between), so a reader or writer that skipped the lock would see or keep a torn pair.
    """
    create_segment("shared", 2 * GIB, tmp_path)
    path = tmp_path / "shared"
    writers, writes_each, engine_steps = 4, 200, 400
    limits = {w: [w * 1_000_000 + i + 1 for i in range(writes_each)] for w in range(writers)}
    allowed_totals = {2 * GIB} | {limit for values in limits.values() for limit in values}
    failures: list[str] = []
    done = threading.Event()

    def engine() -> None:
        for _ in range(engine_steps):
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                _total, used, _prealloc = unpack(os.pread(fd, SEGMENT_SIZE, 0))
                os.pwrite(fd, struct.pack("=q", used + 1), 8)
                os.sched_yield()
                os.pwrite(fd, struct.pack("=q", 2 * (used + 1)), 16)
            finally:
                os.close(fd)

    def agent(w: int) -> None:
        for limit in limits[w]:
            info = write_limit("shared", limit, tmp_path)
            if info.total_size != limit or info.prealloc_size != 2 * info.used_size:
                failures.append(f"writer {w}: {info}")

    def reader() -> None:
        while not done.is_set():
            info = read_segment("shared", tmp_path)
            if info is None or info.prealloc_size != 2 * info.used_size or info.total_size not in allowed_totals:
                failures.append(f"reader: {info}")

    threads = [threading.Thread(target=engine)] + [threading.Thread(target=agent, args=(w,)) for w in range(writers)]
    readers = [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads + readers:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    for thread in readers:
        thread.join()
    assert failures == []
    final = read_segment("shared", tmp_path)
    assert final is not None
    assert (final.used_size, final.prealloc_size) == (engine_steps, 2 * engine_steps)  # no update was lost
    assert final.total_size in {values[-1] for values in limits.values()}


# --- properties -----------------------------------------------------------------------------------


@given(limit=INT64, capacity=INT64)
def test_clamp_is_the_minimum_and_says_when_it_lowered(limit: int, capacity: int) -> None:
    value, clamped = clamp(limit, capacity)
    assert value == min(limit, capacity)
    assert clamped == (limit > capacity)
    assert value <= capacity and (value == limit or clamped)


@given(total=INT64, used=INT64, prealloc=INT64)
def test_pack_and_unpack_are_inverse_and_match_the_native_int64_layout(total: int, used: int, prealloc: int) -> None:
    data = pack(total, used, prealloc)
    assert len(data) == SEGMENT_SIZE
    assert unpack(data) == (total, used, prealloc)
    assert data == struct.pack("qqq", total, used, prealloc)  # native order and alignment: no padding
    assert data[:8] == total.to_bytes(8, sys.byteorder, signed=True)


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(min_value=1, max_value=2**63 - 1),
    used=INT64,
    prealloc=INT64,
    limit=st.integers(min_value=1, max_value=2**63 - 1),
)
def test_any_limit_write_changes_total_size_and_nothing_else(total: int, used: int, prealloc: int, limit: int) -> None:
    with tempfile.TemporaryDirectory() as shm_dir:
        created = create_segment("p", total, shm_dir, used_size=used, prealloc_size=prealloc)
        info = write_limit("p", limit, shm_dir, expected_inode=created.inode)
        assert info == SegmentInfo(limit, used, prealloc, created.inode)
        assert Path(shm_dir, "p").read_bytes() == pack(limit, used, prealloc)


# --- kvcached's own functions ---------------------------------------------------------------------

# A reference reproduction of kvcached.cli.utils (kvcached 0.1.x): the names, signatures, return types
# and locking are kvcached's; so is the flaw that a write lock creates a missing segment.


def _make_reference_kvcached(shm_dir: Path) -> types.ModuleType:
    module = types.ModuleType("kvcached.cli.utils")
    module.SHM_DIR = str(shm_dir)  # type: ignore[attr-defined]
    calls: list[tuple[str, Any]] = []
    module.calls = calls  # type: ignore[attr-defined]

    def get_ipc_path(ipc_name: str) -> str:
        if ipc_name.startswith("/"):
            return ipc_name
        return os.path.join(module.SHM_DIR, ipc_name)

    def get_ipc_name(ipc_path: str) -> str:
        return os.path.basename(ipc_path)

    @dataclass
    class MemInfoStruct:
        total_size: int
        used_size: int
        prealloc_size: int

        N_FIELDS = 3
        SHM_SIZE = 8 * N_FIELDS  # np.dtype(np.int64).itemsize * N_FIELDS

        @classmethod
        def from_buffer(cls, buf: mmap.mmap) -> MemInfoStruct:
            with memoryview(buf) as view, view.cast("q") as arr:  # a native int64 view, like numpy's
                return cls(int(arr[0]), int(arr[1]), int(arr[2]))

        def write_to_buffer(self, buf: mmap.mmap) -> None:
            with memoryview(buf) as view, view.cast("q") as arr:
                arr[0], arr[1], arr[2] = self.total_size, self.used_size, self.prealloc_size

    class RwLockedShm:
        RLOCK = fcntl.LOCK_SH
        WLOCK = fcntl.LOCK_EX

        def __init__(self, file_path: str, size: int, lock_type: int) -> None:
            self.file_path = get_ipc_path(file_path)
            self.size = size
            self.lock_type = lock_type

        def __enter__(self) -> mmap.mmap:
            try:
                self.file = open(self.file_path, "r+b")
            except FileNotFoundError:
                if self.lock_type != RwLockedShm.WLOCK:
                    raise
                self.file = open(self.file_path, "w+b")  # kvcached's flaw: a stray segment appears
                self.file.truncate(self.size)
            if os.fstat(self.file.fileno()).st_size < self.size and self.lock_type == RwLockedShm.WLOCK:
                self.file.truncate(self.size)
            fcntl.flock(self.file, self.lock_type)
            access = mmap.ACCESS_READ if self.lock_type == fcntl.LOCK_SH else mmap.ACCESS_WRITE
            self.mm = mmap.mmap(self.file.fileno(), self.size, access=access)
            return self.mm

        def __exit__(self, *exc: object) -> None:
            self.mm.close()
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()

    def get_kv_cache_limit(ipc_name: str) -> MemInfoStruct | None:
        calls.append(("get", ipc_name))
        try:
            with RwLockedShm(get_ipc_name(ipc_name), MemInfoStruct.SHM_SIZE, RwLockedShm.RLOCK) as mm:
                return MemInfoStruct.from_buffer(mm)
        except FileNotFoundError:
            return None

    def update_kv_cache_limit(ipc_name: str, kv_cache_limit: int) -> MemInfoStruct | None:
        calls.append(("update", ipc_name))
        try:
            with RwLockedShm(get_ipc_name(ipc_name), MemInfoStruct.SHM_SIZE, RwLockedShm.WLOCK) as mm:
                mem_info = MemInfoStruct.from_buffer(mm)
                mem_info.total_size = kv_cache_limit
                mem_info.write_to_buffer(mm)
                print(f"Updated kv cache limit for {ipc_name} to {kv_cache_limit} bytes")
                return mem_info
        except FileNotFoundError:
            return None

    for name, value in {
        "get_ipc_path": get_ipc_path,
        "get_ipc_name": get_ipc_name,
        "MemInfoStruct": MemInfoStruct,
        "RwLockedShm": RwLockedShm,
        "get_kv_cache_limit": get_kv_cache_limit,
        "update_kv_cache_limit": update_kv_cache_limit,
    }.items():
        setattr(module, name, value)
    return module


@pytest.fixture
def reference_kvcached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The reference module installed as ``kvcached.cli.utils``, serving ``tmp_path / 'kvcached-shm'``."""
    shm_dir = tmp_path / "kvcached-shm"
    shm_dir.mkdir()
    module = _make_reference_kvcached(shm_dir)
    package, cli = types.ModuleType("kvcached"), types.ModuleType("kvcached.cli")
    package.__path__ = []
    cli.__path__ = []
    monkeypatch.setitem(sys.modules, "kvcached", package)
    monkeypatch.setitem(sys.modules, "kvcached.cli", cli)
    monkeypatch.setitem(sys.modules, "kvcached.cli.utils", module)
    kv_segment.reset_backend_cache()
    return module


def test_without_kvcached_the_builtin_implementation_is_used(tmp_path: Path) -> None:
    assert backend_name(tmp_path) == "builtin"


def test_kvcached_is_used_only_for_its_own_directory(
    reference_kvcached: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert backend_name(reference_kvcached.SHM_DIR) == "kvcached"
    assert backend_name(tmp_path) == "builtin"  # kvcached's functions cannot reach another directory
    monkeypatch.setenv(kv_segment.BACKEND_ENV, "builtin")
    assert backend_name(reference_kvcached.SHM_DIR) == "builtin"


def test_a_two_field_kvcached_is_not_used(reference_kvcached: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference_kvcached.MemInfoStruct, "SHM_SIZE", 16)
    kv_segment.reset_backend_cache()
    assert backend_name(reference_kvcached.SHM_DIR) == "builtin"


def test_kvcached_functions_and_the_builtin_leave_the_same_bytes(
    reference_kvcached: types.ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    via_kvcached = Path(reference_kvcached.SHM_DIR)
    builtin = tmp_path / "builtin-shm"
    builtin.mkdir()
    assert (backend_name(via_kvcached), backend_name(builtin)) == ("kvcached", "builtin")
    inodes = {d: create_segment("e", 2 * GIB, d, used_size=96 * MIB, prealloc_size=6 * MIB).inode for d in (via_kvcached, builtin)}
    for limit in (GIB, 64 * MIB, 3 * GIB, 1, 2**62):
        results = {d: write_limit("e", limit, d, expected_inode=inodes[d]) for d in (via_kvcached, builtin)}
        assert raw(via_kvcached / "e") == raw(builtin / "e") == pack(limit, 96 * MIB, 6 * MIB)
        assert results[via_kvcached] == SegmentInfo(limit, 96 * MIB, 6 * MIB, inodes[via_kvcached])
        assert results[builtin] == SegmentInfo(limit, 96 * MIB, 6 * MIB, inodes[builtin])
        reads = {d: read_segment("e", d) for d in (via_kvcached, builtin)}
        assert reads[via_kvcached] == results[via_kvcached] and reads[builtin] == results[builtin]
    assert ("update", "e") in reference_kvcached.calls and ("get", "e") in reference_kvcached.calls
    assert "Updated kv cache limit for e" in capsys.readouterr().out


def test_the_kvcached_path_never_lets_kvcached_create_a_stray_segment(reference_kvcached: types.ModuleType) -> None:
    shm_dir = Path(reference_kvcached.SHM_DIR)
    with pytest.raises(SegmentMissing):
        write_limit("nobody", GIB, shm_dir)
    assert read_segment("nobody", shm_dir) is None
    assert list(shm_dir.iterdir()) == []
    assert ("update", "nobody") not in reference_kvcached.calls


def test_the_kvcached_path_checks_size_and_inode_before_calling_kvcached(reference_kvcached: types.ModuleType) -> None:
    shm_dir = Path(reference_kvcached.SHM_DIR)
    (shm_dir / "short").write_bytes(b"\x00" * 16)
    with pytest.raises(SegmentMalformed):
        write_limit("short", GIB, shm_dir)
    with pytest.raises(SegmentMalformed):
        read_segment("short", shm_dir)
    assert raw(shm_dir / "short") == b"\x00" * 16  # kvcached would have grown it to 24 bytes
    old = create_segment("e", GIB, shm_dir)
    new = create_segment("e", GIB, shm_dir)
    with pytest.raises(SegmentReplaced):
        write_limit("e", 1, shm_dir, expected_inode=old.inode)
    assert read_segment("e", shm_dir) == new
    assert ("update", "short") not in reference_kvcached.calls and ("update", "e") not in reference_kvcached.calls


def test_a_segment_replaced_during_the_kvcached_call_is_reported(
    reference_kvcached: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine restarts between our checks and kvcached's own open: the write landed elsewhere."""
    shm_dir = Path(reference_kvcached.SHM_DIR)
    old = create_segment("e", GIB, shm_dir)
    update = reference_kvcached.update_kv_cache_limit

    def restart_then_update(ipc_name: str, limit: int) -> Any:
        create_segment(ipc_name, GIB, shm_dir)
        return update(ipc_name, limit)

    monkeypatch.setattr(reference_kvcached, "update_kv_cache_limit", restart_then_update)
    kv_segment.reset_backend_cache()
    with pytest.raises(SegmentReplaced) as caught:
        write_limit("e", 1, shm_dir, expected_inode=old.inode)
    assert caught.value.expected_inode == old.inode


def test_the_non_blocking_read_matches_the_locked_read_and_never_waits(tmp_path) -> None:
    import fcntl
    import os

    import pytest

    from runtime_agent.kv.segment import (
        create_segment,
        read_segment,
        read_segment_nowait,
    )

    create_segment("nb", 4096, tmp_path)
    assert read_segment_nowait("nb", tmp_path) == read_segment("nb", tmp_path)
    assert read_segment_nowait("missing", tmp_path) is None
    fd = os.open(tmp_path / "nb", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a writer mid-update
        with pytest.raises(BlockingIOError):
            read_segment_nowait("nb", tmp_path)
    finally:
        os.close(fd)


def test_a_segment_renamed_away_and_recreated_is_not_the_one_held_open(tmp_path: Path) -> None:
    """The old inode is still linked (under another name), so only the inode tells."""
    create_segment("kvc_a", GIB, tmp_path)
    path = str(tmp_path / "kvc_a")
    fd = os.open(path, os.O_RDWR)
    try:
        inode = os.fstat(fd).st_ino
        os.rename(path, path + ".old")
        create_segment("kvc_a", 2 * GIB, tmp_path)
        with pytest.raises(SegmentReplaced) as raised:
            kv_segment._check_still_linked(fd, path, inode)
        assert raised.value.path == path and raised.value.expected_inode == inode
        assert raised.value.actual_inode == os.stat(path).st_ino
        os.unlink(path)
        with pytest.raises(SegmentMissing) as missing:
            kv_segment._check_still_linked(fd, path, inode)
        assert missing.value.path == path
    finally:
        os.close(fd)


def test_write_errors_name_the_segment_and_the_bad_value(tmp_path: Path) -> None:
    info = create_segment("kvc_a", GIB, tmp_path)
    path = str(tmp_path / "kvc_a")
    with pytest.raises(SegmentReplaced) as replaced:
        write_limit("kvc_a", GIB, tmp_path, expected_inode=info.inode + 1)
    assert replaced.value.path == path
    with pytest.raises(TypeError, match="^limit_bytes must be an int, not float$"):
        write_limit("kvc_a", 1.5, tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^a KV limit must be positive, got -1$"):
        write_limit("kvc_a", -1, tmp_path)
    with pytest.raises(ValueError, match=f"^a KV limit must fit in int64, got {2**63}$"):
        write_limit("kvc_a", 2**63, tmp_path)
    assert write_limit("kvc_a", 2**63 - 1, tmp_path).total_size == 2**63 - 1  # the largest
