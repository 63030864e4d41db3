"""One agent per state directory: an exclusive lock held for the agent's whole life.

Two agents on one state directory would both take over the same engines and fight (one
restarts what the other stops). The first agent takes ``flock(LOCK_EX)`` on
``<state>/agent.lock`` and writes its pid into it; the lock goes with the process, however it
ends, so a crashed agent never leaves a stale lock behind. A second agent fails at once with
the holder's pid.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path


class StateDirBusy(RuntimeError):
    """Another live agent holds this state directory."""


class StateLock:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "agent.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock (blocking file I/O: call before the event loop is busy, or in a
        thread). Raises StateDirBusy naming the holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StateDirBusy(f"another agent (pid {holder}) already runs on "
                                   f"{self.path.parent}; stop it first or pick another "
                                   "--state-dir") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing drops the flock
            self._fd = None
