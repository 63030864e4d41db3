"""The durable engine registry: one JSON file per engine, written atomically and fsynced.

Why it exists: the agent must be able to restart and find every engine it was supervising
(design principle 4). A record is therefore on disk *before* its process is started, and a
crash at any moment leaves either the old or the new record, never a torn one. Files that are
nevertheless unreadable (a disk fault, a hand edit, an older bug) are moved aside into
``<state_dir>/corrupt/`` for inspection instead of stopping the agent from starting.

Layout::

    <state_dir>/engines/<engine_id>.json     one record per engine
    <state_dir>/engines/.<engine_id>.*.tmp   a save in progress (or a crashed one)
    <state_dir>/corrupt/<name>.<unix-ns>     quarantined files

All methods block on disk I/O; async callers run them in a thread. Saves of different engines
may run concurrently; ``load_all`` removes stray temp files and so must not run concurrently
with ``save`` (the agent calls it once at startup, before any engine task exists).

A save of exactly the bytes the file already holds (read by ``load_all`` or written by a save)
writes nothing: the record is on disk as it stands. Why: a re-adopted engine's first answer
saves its record unchanged, and 32 of them were 64 fsyncs queued on the default thread pool,
half the time from an agent's restart to every engine ready (issue 26).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from msgspec import Struct

from guard.files import fsync_dir, write_atomically

if TYPE_CHECKING:
    from registry.record import EngineRecord

_ENGINE_ID = re.compile(r"[a-f0-9]{8,64}")
_TMP_PREFIX = "."
_TMP_SUFFIX = ".tmp"
_DIR_MODE = 0o700


class Quarantined(Struct, frozen=True):
    """A record file that could not be loaded and was moved aside."""

    original: Path
    kept_at: Path
    reason: str


class LoadResult(Struct, frozen=True):
    records: list[EngineRecord]
    quarantined: list[Quarantined]


def validate_engine_id(engine_id: str) -> str:
    """Return ``engine_id`` if it is 8-64 lowercase hex characters, else raise ValueError."""
    if not isinstance(engine_id, str) or _ENGINE_ID.fullmatch(engine_id) is None:
        raise ValueError(f"invalid engine id {engine_id!r}: expected 8-64 characters [a-f0-9]")
    return engine_id


def _ensure_dir(path: Path) -> None:
    """Create ``path`` and any missing parents (mode 0o700), each made durable in its parent."""
    if path.is_dir():
        return
    _ensure_dir(path.parent)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=_DIR_MODE)
    fsync_dir(path.parent)


class RegistryStore:
    """Durable per-engine records under ``<state_dir>/engines``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.engines_dir = self.state_dir / "engines"
        self.corrupt_dir = self.state_dir / "corrupt"
        # engine id -> the bytes its file holds, durably, as far as this store knows
        self._on_disk: dict[str, bytes] = {}

    def path_for(self, engine_id: str) -> Path:
        return self.engines_dir / f"{validate_engine_id(engine_id)}.json"

    def save(self, record: EngineRecord) -> None:
        """Atomically and durably replace the record file of ``record.engine_id``."""
        final = self.path_for(record.engine_id)
        data = msgspec.json.encode(record)
        if self._on_disk.get(record.engine_id) == data:
            return
        self._on_disk.pop(record.engine_id, None)  # until this save has ended well
        _ensure_dir(self.engines_dir)
        write_atomically(final, data, tmp_prefix=f"{_TMP_PREFIX}{record.engine_id}.",
                         tmp_suffix=_TMP_SUFFIX)
        self._on_disk[record.engine_id] = data

    def delete(self, engine_id: str) -> None:
        """Remove an engine's record durably; a missing record is not an error."""
        path = self.path_for(engine_id)
        self._on_disk.pop(engine_id, None)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        fsync_dir(self.engines_dir)

    def load_all(self) -> LoadResult:
        """Load every record; quarantine bad files and remove stray temp files. Never raises
        for bad file content (only for failures of the state directory itself)."""
        _ensure_dir(self.engines_dir)
        records: list[EngineRecord] = []
        quarantined: list[Quarantined] = []
        removed_tmp = False
        for name in sorted(os.listdir(self.engines_dir)):
            path = self.engines_dir / name
            if name.startswith(_TMP_PREFIX) and name.endswith(_TMP_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed_tmp = True
                continue
            if not name.endswith(".json"):
                continue
            record, reason, data = self._read(path)
            if record is not None:
                records.append(record)
                self._on_disk[record.engine_id] = data
            else:
                quarantined.append(self._quarantine(path, reason))
        if removed_tmp or records:  # what was read is durable in the directory, too
            fsync_dir(self.engines_dir)
        records.sort(key=lambda r: (r.created_at, r.engine_id))
        return LoadResult(records=records, quarantined=quarantined)

    @staticmethod
    def _read(path: Path) -> tuple[EngineRecord | None, str, bytes]:
        """(the record or None, why not, the file's bytes)."""
        expected_id = path.name[: -len(".json")]
        if _ENGINE_ID.fullmatch(expected_id) is None:
            return None, "file name is not a valid engine id", b""
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                return None, "not a regular file", b""
            data = path.read_bytes()
        except OSError as e:
            return None, f"unreadable: {e}", b""
        if not data.strip():
            return None, "empty file", data
        from registry.record import EngineRecord  # loaded with the first record, not at start

        try:
            record = msgspec.json.decode(data, type=EngineRecord)
        except msgspec.ValidationError as e:  # its message names the first field, as `$.spec.port`
            return None, f"invalid record: {e}", data
        except msgspec.DecodeError as e:
            return None, f"not valid JSON: {e}", data
        except RecursionError:  # msgspec's bound on nesting (a free-form field nested deep)
            return None, "invalid record: nested too deep to read", data
        if record.engine_id != expected_id:
            return None, f"engine_id {record.engine_id!r} does not match file name", data
        return record, "", data

    def _quarantine(self, path: Path, reason: str) -> Quarantined:
        kept_at = self.corrupt_dir / f"{path.name}.{time.time_ns()}"
        try:
            _ensure_dir(self.corrupt_dir)
            os.replace(path, kept_at)
        except OSError as e:
            return Quarantined(original=path, kept_at=path, reason=f"{reason}; could not move: {e}")
        with contextlib.suppress(OSError):  # the move is done; its durability is best effort
            fsync_dir(self.corrupt_dir)
            fsync_dir(self.engines_dir)
        return Quarantined(original=path, kept_at=kept_at, reason=reason)
