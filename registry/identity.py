"""Who is this process, really? Identity checks used to re-adopt engines after an agent restart.

Why it exists: a PID alone names a process only while it lives; after an engine dies the kernel
may hand its PID to anything. Re-adoption therefore checks three facts (design principle 4):
the PID, the process start time (field 22 of ``/proc/<pid>/stat``, clock ticks since boot) and
the engine id the agent put into the engine's environment (``ENV_ENGINE_ID``).

Every check of one process opens ``/proc/<pid>`` once and reads its files relative to that
directory descriptor. The kernel binds such a descriptor to one process: if it exits, reads
fail instead of silently describing a newer process that got the same PID, so the start time
and the environment read in one check always belong to the same process.

Linux only. All functions block: /proc reads are fast, but reading the environment of a process
still inside exec waits up to ``EXEC_SETTLE_S`` for it to finish. Async callers run them in a
thread.
"""

from __future__ import annotations

import enum
import errno
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from msgspec import Struct

from registry.env import ENV_ENGINE_ID, ENV_STATE_DIR

_GONE_ERRORS = (FileNotFoundError, ProcessLookupError)
_DEAD_STATES = frozenset({"Z", "X", "x"})
# 1-based field numbers in proc(5); field 3 (state) is the first after ``(comm)``.
_FIRST_AFTER_COMM = 3
_PPID_FIELD = 4
_FLAGS_FIELD = 9
_STARTTIME_FIELD = 22
_ENV_END_FIELD = 51
_PF_KTHREAD = 0x00200000
# How long an identity check waits for an exec in progress to set up the new environment.
EXEC_SETTLE_S = 0.5


class ExecInProgress(OSError):
    """The process was still inside exec (no environment yet) when the wait ran out."""


class Verdict(enum.Enum):
    MATCH = "match"  # the same process the agent started: adopt it
    GONE = "gone"  # no such process, or only its zombie remains
    REUSED = "reused"  # a different process now has this PID
    UNREADABLE = "unreadable"  # alive, but its environment cannot be read: do not adopt


class StatFields(Struct, frozen=True):
    """The few fields of ``/proc/<pid>/stat`` the agent needs."""

    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    flags: int
    start_time: int
    env_end: int | None  # field 51 (Linux >= 3.5); 0 until an exec has set up the new image

    @property
    def is_kernel_thread(self) -> bool:
        return bool(self.flags & _PF_KTHREAD)

    @property
    def exec_in_progress(self) -> bool:
        """An exec has replaced the memory image but not yet placed the new environment: for
        these few milliseconds /proc shows an empty environment."""
        return self.env_end == 0 and not self.is_kernel_thread


class FoundEngine(Struct, frozen=True):
    pid: int
    start_time: int
    environ: dict[str, str]
    pgid: int = 0  # its process group: an engine the agent started leads its own (setsid)

    @property
    def leads_its_group(self) -> bool:
        """The agent starts every engine as a session and group leader; a worker whose leader
        died (an orphaned EngineCore) carries the engine's id but not its group."""
        return self.pid == self.pgid


def parse_stat(line: str) -> StatFields:
    """Parse one ``/proc/<pid>/stat`` line.

    The second field is ``(comm)``, and comm may itself contain spaces and parentheses, so the
    line is split at the LAST ``)``; fields 3.. follow it, separated by single spaces.
    """
    open_paren = line.find("(")
    close_paren = line.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        raise ValueError(f"malformed stat line: {line[:80]!r}")
    rest = line[close_paren + 1 :].split()

    def field(number: int) -> int:
        return int(rest[number - _FIRST_AFTER_COMM])

    if len(rest) < _STARTTIME_FIELD - _FIRST_AFTER_COMM + 1:
        raise ValueError(f"stat line has too few fields: {line[:80]!r}")
    has_env_end = len(rest) > _ENV_END_FIELD - _FIRST_AFTER_COMM
    return StatFields(
        comm=line[open_paren + 1 : close_paren],
        state=rest[0],
        ppid=field(_PPID_FIELD),
        pgrp=field(_PPID_FIELD + 1),
        session=field(_PPID_FIELD + 2),
        flags=field(_FLAGS_FIELD),
        start_time=field(_STARTTIME_FIELD),
        env_end=field(_ENV_END_FIELD) if has_env_end else None,
    )


def parse_environ(raw: bytes) -> dict[str, str]:
    """Parse NUL-separated ``KEY=VALUE`` entries; entries without ``=`` are skipped and, as
    with getenv, the first of duplicate keys wins. Undecodable bytes are surrogate-escaped."""
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep and key:
            env.setdefault(os.fsdecode(key), os.fsdecode(value))
    return env


@contextmanager
def _proc_dir(pid: int) -> Iterator[int | None]:
    """A descriptor of ``/proc/<pid>`` bound to that one process, or None if it is gone."""
    if pid <= 0:
        yield None
        return
    try:
        fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    except _GONE_ERRORS:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _read_at(dir_fd: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _live_stat_at(dir_fd: int) -> StatFields | None:
    """The process's stat fields, or None when it has exited (including as a zombie)."""
    try:
        raw = _read_at(dir_fd, "stat")
    except _GONE_ERRORS:
        return None
    fields = parse_stat(os.fsdecode(raw))
    return None if fields.state in _DEAD_STATES else fields


def _environ_at(dir_fd: int) -> dict[str, str]:
    """The process's environment, waiting out an exec in progress.

    Right after a process is spawned (``Popen`` has already returned) the kernel may still be
    building the new image, and /proc shows an empty environment for a few milliseconds. An
    empty read is therefore trusted only once stat shows the exec has finished. Raises
    ProcessLookupError/FileNotFoundError if the process exits, PermissionError if it is not
    ours, ExecInProgress if the exec does not finish within ``EXEC_SETTLE_S``.
    """
    deadline = time.monotonic() + EXEC_SETTLE_S
    delay = 0.001
    while True:
        env = parse_environ(_read_at(dir_fd, "environ"))
        if env:
            return env
        fields = _live_stat_at(dir_fd)
        if fields is None:
            raise ProcessLookupError(errno.ESRCH, "process exited")
        if not fields.exec_in_progress:
            # The exec may have finished between the two reads: read once more.
            return parse_environ(_read_at(dir_fd, "environ"))
        if time.monotonic() >= deadline:
            raise ExecInProgress(errno.EAGAIN, "process is still inside exec")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None if it is gone or a zombie."""
    with _proc_dir(pid) as dir_fd:
        if dir_fd is None:
            return None
        fields = _live_stat_at(dir_fd)
        return None if fields is None else fields.start_time


def read_environ(pid: int) -> dict[str, str] | None:
    """The initial environment of ``pid``; None when it is gone (a zombie included) or cannot
    be read (another user's process, or still inside exec after ``EXEC_SETTLE_S``). A kernel
    thread has an empty environment."""
    with _proc_dir(pid) as dir_fd:
        if dir_fd is None:
            return None
        try:
            return _environ_at(dir_fd)
        except OSError:
            return None


def verify(pid: int, start_time: int, engine_id: str) -> Verdict:
    """Is ``pid`` still the engine ``engine_id`` that started at ``start_time``?"""
    with _proc_dir(pid) as dir_fd:
        if dir_fd is None:
            return Verdict.GONE
        fields = _live_stat_at(dir_fd)
        if fields is None:
            return Verdict.GONE
        if fields.start_time != start_time:
            return Verdict.REUSED
        try:
            env = _environ_at(dir_fd)
        except _GONE_ERRORS:
            return Verdict.GONE
        except OSError:
            return Verdict.GONE if _live_stat_at(dir_fd) is None else Verdict.UNREADABLE
        if env.get(ENV_ENGINE_ID) != engine_id:
            # Cheap insurance: a process exiting between the two reads must read as GONE.
            return Verdict.GONE if _live_stat_at(dir_fd) is None else Verdict.REUSED
        return Verdict.MATCH


def live_processes() -> dict[int, StatFields]:
    """The stat fields of every live process (kernel threads and zombies left out), one read
    of ``/proc/<pid>/stat`` each; processes that vanish or cannot be read are skipped."""
    found: dict[int, StatFields] = {}
    for name in os.listdir("/proc"):
        if not (name.isascii() and name.isdigit()):
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = parse_stat(os.fsdecode(fh.read()))
        except (OSError, ValueError):
            continue
        if fields.state not in _DEAD_STATES and not fields.is_kernel_thread:
            found[int(name)] = fields
    return found


def scan_engines(state_dir: str | os.PathLike[str], *, every: bool = False
                 ) -> list[FoundEngine]:
    """Every live engine top process started by the agent owning ``state_dir``, by PID.

    A process counts when its environment has ``ENV_STATE_DIR == state_dir`` and an
    ``ENV_ENGINE_ID``, unless its parent has the same engine id (a worker that merely inherited
    the engine's environment). With ``every``, workers too: each process that carries an engine
    id (leftovers to kill). Processes that vanish or cannot be read mid-scan are skipped.
    """
    wanted = os.fspath(state_dir)
    candidates: dict[int, tuple[StatFields, dict[str, str]]] = {}
    for name in os.listdir("/proc"):
        if not (name.isascii() and name.isdigit()):
            continue
        with _proc_dir(int(name)) as dir_fd:
            if dir_fd is None:
                continue
            try:
                fields = _live_stat_at(dir_fd)
                if fields is None or fields.is_kernel_thread:
                    continue
                env = _environ_at(dir_fd)
            except OSError:
                continue
            if env.get(ENV_STATE_DIR) == wanted and env.get(ENV_ENGINE_ID):
                candidates[int(name)] = (fields, env)

    outside_ids: dict[int, str | None] = {}  # engine id of parents that are not candidates

    def engine_id_of(pid: int) -> str | None:
        if pid in candidates:
            return candidates[pid][1][ENV_ENGINE_ID]
        if pid not in outside_ids:
            env = read_environ(pid)
            outside_ids[pid] = None if env is None else env.get(ENV_ENGINE_ID)
        return outside_ids[pid]

    return [
        FoundEngine(pid=pid, start_time=fields.start_time, environ=env, pgid=fields.pgrp)
        for pid, (fields, env) in sorted(candidates.items())
        if every or engine_id_of(fields.ppid) != env[ENV_ENGINE_ID]
    ]


def pid_namespace_pids(pid: int) -> list[int] | None:
    """The ``NSpid:`` line of ``/proc/<pid>/status``: the PID in each nested PID namespace,
    outermost (as seen by this /proc) first. None if the process is gone or the kernel has no
    NSpid line."""
    with _proc_dir(pid) as dir_fd:
        if dir_fd is None:
            return None
        try:
            raw = _read_at(dir_fd, "status")
        except _GONE_ERRORS:
            return None
    for line in os.fsdecode(raw).splitlines():
        if line.startswith("NSpid:"):
            return [int(part) for part in line.split()[1:]]
    return None
