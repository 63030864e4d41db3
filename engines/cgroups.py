"""One cgroup (v2) per engine, where the agent may create them: the whole engine, found and
killed by the kernel.

A process group misses what leaves it (``setsid``), and the engine id in the environment misses
what clears its environment (``env -i``, a daemon that re-executes itself). A cgroup misses
nothing a process forks: ``cgroup.kill`` (Linux 5.14) SIGKILLs every member at once, and
``cgroup.events`` says when it is empty. systemd stops a service this way.

The engine enters its cgroup before it runs any code of its own: it is started through
``/bin/sh -c 'echo 0 > "$0/cgroup.procs"; exec "$@"'``, so the shell moves itself (the pid
that becomes the engine) and then executes the engine in place. Where no cgroup can be created
(cgroup v1 only, a read-only ``/sys/fs/cgroup`` in an unprivileged container) the agent says so
once at start and relies on the process group and the engine id, as before.

Layout: ``<the agent's own cgroup>/runtime-agent.<hash of the state dir>/<engine id>``; two agents
on one node (different state directories) never share a directory, and a restarted agent finds
its engines' cgroups again from its state directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

# The shell moves itself into the cgroup named by $0 and becomes the engine. A failed move (the
# cgroup was removed meanwhile) leaves the engine to the process group and the engine id.
SHIM = 'echo 0 > "$0/cgroup.procs" 2>/dev/null; exec "$@"'


def v2_mount(mountinfo: str) -> str | None:
    """The mount point of the cgroup v2 hierarchy in ``/proc/self/mountinfo`` text."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if sep and right.split(" ", 1)[0] == "cgroup2":
            fields = left.split(" ")
            if len(fields) > 4:
                return fields[4].replace("\\040", " ")
    return None


def v2_path(proc_cgroup: str) -> str | None:
    """A process's cgroup v2 path from ``/proc/<pid>/cgroup`` text (the ``0::`` line)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return None


def agent_dir_name(state_dir: str) -> str:
    return "runtime-agent." + hashlib.sha256(os.path.abspath(state_dir).encode()).hexdigest()[:12]


class EngineCgroups:
    """The cgroups of one agent's engines, under ``root``. Every method but ``remove`` and
    ``sweep`` (which wait for exits) is a few cgroupfs reads or writes: safe on the event loop."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def discover(cls, state_dir: str, proc: Path = Path("/proc")
                 ) -> tuple[EngineCgroups | None, str]:
        """This agent's engine cgroups, created under its own cgroup; or None and why not."""
        try:
            mount = v2_mount((proc / "self" / "mountinfo").read_text())
            own = v2_path((proc / "self" / "cgroup").read_text())
        except OSError as exc:
            return None, f"cannot read this process's cgroup ({exc.strerror})"
        if mount is None or own is None:
            return None, "no cgroup v2 hierarchy is mounted"
        root = Path(mount) / own.lstrip("/") / agent_dir_name(state_dir)
        try:
            root.mkdir(exist_ok=True)
        except OSError as exc:
            return None, f"cannot create {root} ({exc.strerror})"
        if not (root / "cgroup.procs").exists():
            return None, f"{root} is not a cgroup directory"
        return cls(root), str(root)

    def path(self, engine_id: str) -> Path:
        return self.root / engine_id

    def wrap(self, argv: Sequence[str], engine_id: str) -> list[str]:
        """The command that starts ``argv`` inside the engine's cgroup (created here); ``argv``
        unchanged when it cannot be created."""
        target = self.path(engine_id)
        try:
            target.mkdir(exist_ok=True)
        except OSError:
            return list(argv)
        return ["/bin/sh", "-c", SHIM, str(target), *argv]

    def members(self, engine_id: str) -> list[int]:
        try:
            text = (self.path(engine_id) / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(line) for line in text.split()]

    def kill(self, engine_id: str) -> bool:
        """SIGKILL every process in the engine's cgroup; True when there was a cgroup."""
        target = self.path(engine_id)
        if not target.is_dir():
            return False
        try:
            (target / "cgroup.kill").write_text("1")
        except OSError:  # before Linux 5.14: one by one, until none is left to add members
            for _ in range(10):
                pids = self.members(engine_id)
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
        return True

    def remove(self, engine_id: str, wait_s: float = 2.0) -> bool:
        """Remove the engine's (emptied) cgroup; the kernel empties it as its members' exits
        complete. True when it is gone."""
        target = self.path(engine_id)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                target.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:  # EBUSY: members are still exiting
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.01)

    def engine_ids(self) -> list[str]:
        try:
            return sorted(p.name for p in self.root.iterdir() if p.is_dir())
        except OSError:
            return []

    def sweep(self, keep: set[str]) -> list[str]:
        """Kill and remove every engine cgroup not in ``keep`` (after a restart: engines whose
        leader died while no agent watched); the ids swept that still had members."""
        swept = []
        for engine_id in self.engine_ids():
            if engine_id in keep:
                continue
            if self.members(engine_id):
                swept.append(engine_id)
            self.kill(engine_id)
            self.remove(engine_id)
        return swept

    def remove_root(self) -> bool:
        """Remove this agent's (empty) directory: only when no engine cgroup is left."""
        try:
            self.root.rmdir()
        except OSError:
            return False
        return True
