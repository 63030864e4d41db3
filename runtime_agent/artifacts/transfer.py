"""One download, start to end, in a worker thread: every planned file fetched into the staging
directory, checked, and only then given its real name.

A file grows as ``NAME.part``; a part left by an earlier try is the prefix to resume from. When
its bytes are complete, it is fsynced and its size and checksum checked: a wrong size or
checksum removes the part (it can never become right) and fails the download with the reason;
a short part from a broken connection stays, to be resumed. Only a checked file is renamed to
its name, so a file with its real name in a staging directory is always whole.
"""

from __future__ import annotations

import errno
import os
import threading
import unicodedata
from pathlib import Path

from guard.files import fsync_dir
from runtime_agent.artifacts.manifest import Plan, PlannedFile
from runtime_agent.artifacts.sources.base import FetchError, FetchKind, Source
from runtime_agent.artifacts.verify import Cancelled, HashingWriter, Progress, choose

PART = ".part"


def safe_path(root: Path, relative: str) -> Path:
    """``root/relative``, refusing names that would leave ``root`` (a hostile listing), and
    names with a NUL or another control character (no file system call would take a NUL: it
    would end the download with a ValueError instead of a refusal)."""
    norm = os.path.normpath(relative)
    if not relative or norm.startswith(("..", "/")) or os.path.isabs(relative) or norm == "." \
            or any(unicodedata.category(c) == "Cc" for c in relative):
        raise FetchError(FetchKind.REFUSED, f"the source lists a file named {relative!r}, which "
                         "would land outside the artifact's directory")
    return root / norm


def bytes_on_disk(files_dir: Path, plan: Plan) -> int:
    """What earlier tries left of this plan: whole files and parts (blocking)."""
    total = 0
    for f in plan.files:
        final = safe_path(files_dir, f.path)
        for path in (final, final.with_name(final.name + PART)):
            try:
                total += min(path.stat().st_size, f.size)
                break
            except OSError:
                continue
    return total


def transfer(source: Source, plan: Plan, files_dir: Path, progress: Progress,
             cancelled: threading.Event) -> tuple[str, ...]:
    """Fetch every file of ``plan``; the checksum algorithms checked (blocking)."""
    progress.total = plan.total_bytes
    progress.done = 0
    files_dir.mkdir(parents=True, exist_ok=True)
    checked: set[str] = set()
    try:
        for f in plan.files:
            algorithm = _one(source, f, safe_path(files_dir, f.path), progress, cancelled)
            if algorithm is not None:
                checked.add(algorithm)
        for directory in {safe_path(files_dir, f.path).parent for f in plan.files}:
            fsync_dir(directory)
    except Cancelled:
        raise FetchError(FetchKind.CANCELLED, "the download was cancelled") from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise FetchError(FetchKind.DISK, f"the disk filled up during the download ({exc}); "
                             "the files so far are kept to resume") from None
        raise FetchError(FetchKind.DISK, f"cannot write the download: {exc}") from None
    return tuple(sorted(checked))


def _one(source: Source, f: PlannedFile, final: Path, progress: Progress,
         cancelled: threading.Event) -> str | None:
    algorithm = choose(f.checksums)
    if final.is_file() and final.stat().st_size == f.size:
        progress.add(f.size)  # checked before it got its name
        return algorithm
    final.parent.mkdir(parents=True, exist_ok=True)
    part = final.with_name(final.name + PART)
    offset = part.stat().st_size if part.exists() else 0
    if offset > f.size:
        part.unlink()
        offset = 0
    with open(part, "a+b") as fh:
        writer = HashingWriter(fh, algorithm, f.size, offset, progress, cancelled)
        try:
            source.fetch(f, writer, offset)
        except FetchError as exc:
            if exc.kind is FetchKind.CHANGED:
                part.unlink(missing_ok=True)
            raise
        finally:
            writer.close()
        fh.flush()
        os.fsync(fh.fileno())
        size, digest = writer.pos, writer.hexdigest()
    if size != f.size:
        if size > f.size:
            part.unlink(missing_ok=True)
        raise FetchError(FetchKind.NETWORK, f"{f.path}: got {size} of {f.size} bytes")
    if algorithm is not None and digest != f.checksums[algorithm]:
        part.unlink(missing_ok=True)
        raise FetchError(FetchKind.CHECKSUM, f"{f.path}: {algorithm} of the bytes received is "
                         f"{digest}, the source announced {f.checksums[algorithm]}; the file "
                         "was removed and will be fetched whole again")
    os.rename(part, final)
    return algorithm


def drop_stale(files_dir: Path, old: Plan, new: Plan) -> None:
    """Remove what an earlier try left of files the new plan sees differently (another commit,
    another object version) or no longer lists: never resume into a different file (blocking)."""
    before = {f.path: f for f in old.files}
    wanted = {f.path: f for f in new.files}
    for path, f in before.items():
        if wanted.get(path) == f:
            continue
        final = safe_path(files_dir, path)
        final.unlink(missing_ok=True)
        final.with_name(final.name + PART).unlink(missing_ok=True)
