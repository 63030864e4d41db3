"""Engine processes: start one in its own session, watch it through a pidfd, stop its group.

This is the only module that forks, signals or reaps. An engine runs in a new session (so in
its own process group), with stdout and stderr appended to its log file. Its exit is observed
through ``os.pidfd_open`` and the event loop's ``add_reader``, for engines this agent started
and for engines it re-adopted after a restart alike: the kernel tells us within microseconds,
no polling loop is involved.

For a child of this agent the exit status is read with ``waitid(P_PIDFD)``; a re-adopted engine
is not our child, so its status is unknown and is reported as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil
from msgspec import Struct

from engines.cgroups import EngineCgroups
from registry.identity import StatFields, live_processes, process_start_time, scan_engines
from registry.env import ENV_ENGINE_ID


class ExitInfo(Struct, frozen=True):
    """How an engine process ended. ``code``/``signal`` are None when unknown (not our child)."""

    code: int | None
    signal: int | None
    detected_at: float  # time.monotonic() when the agent saw it
    lingering: bool = False  # still there after SIGKILL and the kill wait (uninterruptible)

    def describe(self) -> str:
        if self.lingering:
            return ("did not end within the kill wait after SIGKILL (stuck in an "
                    "uninterruptible wait, such as a hung device or file system)")
        if self.signal is not None:
            return f"killed by signal {signal.Signals(self.signal).name}"
        if self.code is not None:
            return f"exited with code {self.code}"
        return "exited (status unknown: the process was re-adopted, not started by this agent)"


class SpawnError(RuntimeError):
    """The engine could not be started at all (missing executable, bad working directory)."""


class EngineProcess:
    """One running engine process (the leader of its process group) and its exit watch."""

    def __init__(self, pid: int, start_time: int, is_child: bool) -> None:
        self.pid = pid
        self.start_time = start_time
        self.is_child = is_child
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[ExitInfo] = loop.create_future()
        self._loop = loop
        self._pidfd = os.pidfd_open(pid)
        self._worker_fds: list[int] = []
        loop.add_reader(self._pidfd, self._on_pidfd_readable)

    def _on_pidfd_readable(self) -> None:
        detected_at = time.monotonic()
        self._loop.remove_reader(self._pidfd)
        info = ExitInfo(code=None, signal=None, detected_at=detected_at)
        if self.is_child:
            with contextlib.suppress(ChildProcessError, OSError):
                result = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
                if result is not None:
                    if result.si_code == os.CLD_EXITED:
                        info = ExitInfo(result.si_status, None, detected_at)
                    else:
                        info = ExitInfo(None, result.si_status, detected_at)
        os.close(self._pidfd)
        self._pidfd = -1
        self._forget_workers()
        # The leader is gone; whatever it left in its group (workers, engine cores) goes too
        # (what left the group: the owner's ProcessLauncher.kill_leftovers, next).
        self.signal_group(signal.SIGKILL)
        if not self.exited.done():
            self.exited.set_result(info)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the engine's whole process group (its pgid is its pid)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def stop(self, grace_s: float, kill_wait_s: float = 10.0) -> ExitInfo:
        """SIGTERM the group, wait ``grace_s``, then SIGKILL it; no descendant survives. Ends
        within ``grace_s + kill_wait_s``: a process that outlives SIGKILL that long (stuck in
        the kernel) is reported ``lingering``."""
        if self.exited.done():
            return self.exited.result()
        descendants = await asyncio.to_thread(_descendants, self.pid)  # blocking /proc reads
        self.signal_group(signal.SIGTERM)
        try:
            info = await asyncio.wait_for(asyncio.shield(self.exited), grace_s)
        except TimeoutError:
            self.signal_group(signal.SIGKILL)
            try:
                info = await asyncio.wait_for(asyncio.shield(self.exited), kill_wait_s)
            except TimeoutError:
                return ExitInfo(None, None, time.monotonic(), lingering=True)
        # Descendants that left the group (setsid) are found by the tree taken before the stop.
        await asyncio.to_thread(_kill_survivors, descendants)
        return info

    def watch_workers(self, workers: Sequence[tuple[int, str]],
                      on_exit: Callable[[int, str], None]) -> None:
        """Watch the engine's workers (``group_workers``) through pidfds: ``on_exit(pid,
        name)`` when one ends while the leader lives. An engine whose EngineCore died is dead
        though its API server still answers."""
        for pid, name in workers:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                on_exit(pid, name)  # gone already
                continue
            self._worker_fds.append(fd)

            def ended(fd: int = fd, pid: int = pid, name: str = name) -> None:
                self._loop.remove_reader(fd)
                if not self.exited.done():
                    on_exit(pid, name)

            self._loop.add_reader(fd, ended)

    def _forget_workers(self) -> None:
        for fd in self._worker_fds:
            self._loop.remove_reader(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._worker_fds.clear()

    def close(self) -> None:
        """Stop watching without touching the process (the agent is shutting down)."""
        self._forget_workers()
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        if not self.exited.done():
            self.exited.cancel()


def group_workers(leader: int) -> list[tuple[int, str]]:
    """The descendants of ``leader`` in its process group (blocking /proc reads: call in a
    thread): its workers, as (pid, name). Helpers that left the group are not workers.

    The process table is ``_TABLE``'s: 32 engines re-adopted or started at once share one or
    two scans of every process instead of making 32 (issue 26)."""
    table, children = _TABLE.read_tree(time.monotonic())
    found = []
    todo = list(children.get(leader, ()))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        if table[pid].pgrp == leader:
            found.append((pid, table[pid].comm))
    return sorted(found)


class _SharedScan:
    """Every live process's stat fields, one scan shared by the threads that ask at once.

    A caller gets a scan that began after it asked (``asked``, monotonic), never an older one,
    so every process that existed when it asked is in its answer. Callers that queue while a
    scan runs share the next one: a burst of N callers costs two scans, not N."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._began = -1.0
        self._table: dict[int, StatFields] = {}
        self._children: dict[int, list[int]] = {}

    def read(self, asked: float) -> dict[int, StatFields]:
        return self.read_tree(asked)[0]

    def read_tree(self, asked: float) -> tuple[dict[int, StatFields], dict[int, list[int]]]:
        """The table and each pid's children in it, built once per scan for all who share it."""
        with self._lock:
            if self._began < asked:
                self._began = time.monotonic()
                self._table = live_processes()
                self._children = {}
                for pid, fields in self._table.items():
                    self._children.setdefault(fields.ppid, []).append(pid)
            return self._table, self._children


_TABLE = _SharedScan()


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except (psutil.Error, OSError):  # gone, or /proc unreadable now (no descriptors left)
        return []


def _kill_survivors(processes: Sequence[psutil.Process]) -> None:
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            if proc.is_running():  # is_running checks the create time: no reused PID is hit
                proc.kill()


def kill_leftovers(state_dir: str, engine_id: str, spare: int | None = None) -> list[int]:
    """SIGKILL every process that carries ``engine_id`` in its environment (blocking /proc
    reads: call in a thread): the descendants that left the engine's process group (a
    ``setsid`` worker, a daemon) die with a crash as they do with a stop. ``spare``: a pid to
    leave alone. The ids of the processes signalled."""
    killed = []
    for found in scan_engines(state_dir, every=True):
        if found.environ.get(ENV_ENGINE_ID) != engine_id or found.pid == spare:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(found.pid, signal.SIGKILL)
            killed.append(found.pid)
    return killed


def resolve_executable(name: str) -> str:
    if os.sep in name:
        if not os.access(name, os.X_OK):
            raise SpawnError(f"engine executable {name!r} does not exist or is not executable")
        return name
    found = shutil.which(name)
    if found is None:
        raise SpawnError(f"engine executable {name!r} was not found on PATH")
    return found


def _spawn_blocking(argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path,
                    shown: Sequence[str]) -> int:
    """Start ``argv`` in a new session, in ``cwd``; the log's header names ``shown`` (the
    engine's own command line, without the cgroup shim).

    Through ``subprocess.Popen`` (vfork, then exec), which lets go of the interpreter lock
    while the child gets to its exec; ``os.posix_spawn`` holds it throughout, so on a busy
    node every start froze the event loop until its child was scheduled (30 starts among 30
    busy processes: 720 ms frozen, against 5 ms). The Popen object is dropped at once and
    never reaps: the engine's exit is read through its pidfd (``EngineProcess``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    executable = resolve_executable(argv[0])
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    try:
        header = f"=== engine start {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {' '.join(shown)}\n"
        os.write(log_fd, header.encode())
        try:
            child = subprocess.Popen(list(argv), executable=executable, env=dict(env), cwd=cwd,
                                     stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                     start_new_session=True)
        except OSError as exc:  # no such directory, not executable: said before any start
            raise SpawnError(f"cannot start {executable!r} in {os.fspath(cwd)!r}: "
                             f"{exc.strerror or exc}") from None
        # A Popen collected while its child runs is listed for subprocess's own sweep, which
        # reaps with waitpid (the exit status the pidfd watch needs, or a reused pid's): a
        # return code set here keeps it out of that list.
        child.returncode = 0
        return child.pid
    finally:
        os.close(log_fd)


class ProcessLauncher:
    """Starts engine processes, attaches to running ones and ends what an engine leaves behind.
    Engines run in ``cwd``: the agent gives them an empty directory of its own, because vLLM
    takes a relative ``lora_path`` or ``--model`` that exists there as a local path. With
    ``cgroups`` each engine runs in its own cgroup (``engines/cgroups.py``). Tests use the
    same class."""

    def __init__(self, cwd: Path | None = None, cgroups: EngineCgroups | None = None) -> None:
        self._cwd = cwd or Path.cwd()
        self.cgroups = cgroups

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path
    ) -> EngineProcess:
        engine_id = env.get(ENV_ENGINE_ID)
        command = list(argv)
        if self.cgroups is not None and engine_id:  # the shell finds no executable of its own
            command = self.cgroups.wrap([resolve_executable(argv[0]), *argv[1:]], engine_id)
        # The start and the log header are blocking syscalls: run them off the event loop.
        pid = await asyncio.to_thread(_spawn_blocking, command, env, log_path, self._cwd, argv)
        start_time = process_start_time(pid)
        if start_time is None:  # exited before we looked: still watch it to get its status
            start_time = 0
        return EngineProcess(pid, start_time, is_child=True)

    def attach(self, pid: int) -> EngineProcess | None:
        """Watch a running engine this agent did not start; None when it is already gone."""
        start_time = process_start_time(pid)
        if start_time is None:
            return None
        try:
            return EngineProcess(pid, start_time, is_child=False)
        except ProcessLookupError:
            return None

    def kill_leftovers(self, state_dir: str, engine_id: str) -> list[int]:
        """After an engine ended: SIGKILL what it left (its cgroup, then every process that
        carries its id) and remove its cgroup (blocking: call in a thread). The pids found."""
        members = self.cgroups.members(engine_id) if self.cgroups is not None else []
        if self.cgroups is not None:
            self.cgroups.kill(engine_id)
        killed = kill_leftovers(state_dir, engine_id)
        if self.cgroups is not None:
            self.cgroups.remove(engine_id)
        return sorted(set(members) | set(killed))


def tail_lines(path: Path, lines: int = 20, max_bytes: int = 16384) -> list[str]:
    """The last ``lines`` lines of a log file (blocking; call in a thread)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace")
    return [line for line in text.splitlines() if line.strip()][-lines:]


def trim_log(path: Path, max_bytes: int) -> bool:
    """Copy-truncate a log that grew past ``max_bytes``: its older half goes to ``<log>.1``.

    The engine holds the file open with O_APPEND, so after the truncate its next write lands at
    the new end. Blocking; call in a thread. Returns True when it trimmed.
    """
    try:
        size = path.stat().st_size
    except OSError:
        return False
    if size <= max_bytes:
        return False
    with path.open("rb") as src, path.with_name(path.name + ".1").open("wb") as old:
        shutil.copyfileobj(src, old)
    with path.open("r+b") as fh:
        fh.truncate(0)
    return True
