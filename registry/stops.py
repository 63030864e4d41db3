"""A stop the registry could not record, remembered beside the engines' KV segments instead.

Why it exists: a deactivate changes the registry first (the record says ``stopping``, or is
removed) so that a restarted agent does not start again what it finds recorded (it restarts
every recorded engine whose process is gone: a crash while no agent watched). On a read-only
state directory neither change can be made, and the stop used to be refused (503) though the
engine could be ended. The stop is now remembered in a small marker on the machine's KV
segment directory (``/dev/shm`` on a node: it outlives the agent, as the engines do), and a
restarted agent that finds a record with a marker finishes the stop instead of restarting it.
The record's PID and start time still decide whether a running process is that engine's (a
reused PID is never signalled). Once the record is removed, the marker is removed too.

Layout: ``<dir>/<engine_id>.stopped`` (a ``.`` is never in a kvcached segment name, so no
segment can be called that), holding the state directory that made it, so two agents sharing
the directory never read each other's. A marker lost with the tmpfs (a reboot) while the
state directory stayed read-only lets the next agent start the engine again: the one case
this cannot cover. Blocking file I/O on tmpfs (microseconds); async callers use a thread.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from registry.store import validate_engine_id

_SUFFIX = ".stopped"
_MAX = 4096


def marker_path(directory: Path, engine_id: str) -> Path:
    return directory / f"{validate_engine_id(engine_id)}{_SUFFIX}"


def mark(directory: Path, state_dir: str, engine_id: str) -> Path:
    """Remember that ``engine_id`` of the agent owning ``state_dir`` is being stopped; raises
    OSError when the marker cannot be written either (then nothing may be stopped)."""
    path = marker_path(directory, engine_id)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, json.dumps({"state_dir": state_dir, "engine_id": engine_id}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def marked(directory: Path, state_dir: str, engine_id: str) -> bool:
    """Was a stop of ``engine_id`` remembered here by the agent owning ``state_dir``?"""
    try:
        fd = os.open(marker_path(directory, engine_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, ValueError):
        return False
    try:
        data = json.loads(os.read(fd, _MAX))
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)
    return isinstance(data, dict) and data.get("state_dir") == state_dir \
        and data.get("engine_id") == engine_id


def clear(directory: Path, engine_id: str) -> None:
    """The record is gone: so is its marker (if any)."""
    with contextlib.suppress(FileNotFoundError, ValueError):
        os.unlink(marker_path(directory, engine_id))
