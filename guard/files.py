"""Durable writes: a file is replaced whole or not at all, and the replacement survives a crash.

The registry's engine records, the reconciler's claim statuses and the weight cache's manifests
are all read back after a crash; a reader must never find half a file. One helper writes each:
a temporary file in the same directory (so the rename cannot cross filesystems), fsync, rename
over the old one, fsync of the directory (so the rename itself is on disk). A failure leaves the
old file as it was and removes the temporary one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes, *, tmp_prefix: str | None = None,
                     tmp_suffix: str = ".tmp", sync_dir: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically and durably (blocking: call in a thread).

    The temporary file is ``<tmp_prefix><random><tmp_suffix>`` in ``path``'s directory
    (``tmp_prefix`` defaults to ``.<name>.``), so a reader that lists the directory can tell a
    leftover from a crash by its name. ``sync_dir=False`` leaves the directory's fsync to a
    caller that syncs it once after several writes."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=tmp_prefix or f".{path.name}.",
                               suffix=tmp_suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(path.parent)
