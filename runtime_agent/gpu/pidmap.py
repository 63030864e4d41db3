"""Translating the PIDs NVML reports into PIDs of the agent's own PID namespace.

Inside a container NVML reports *host* PIDs, while the agent knows its engines by the PIDs of its
own namespace. The kernel states both in the ``NSpid:`` line of ``/proc/<pid>/status``: the first
number is the PID in the namespace of that procfs mount, the last the PID in the process's own
namespace. A procfs mounted by the container itself starts at the container's level, so it shows
a single number and the host PID cannot be learnt from it: the mapping needs a procfs of an outer
namespace (``hostPID: true``, or the host's ``/proc`` mounted and passed as ``proc_root``).

Three outcomes for an NVML PID, and never a guess:

* the procfs shows outer levels ("nested"): a PID found in the host->local map is ours; any other
  PID belongs to a process outside our namespace (another container), so it is foreign, not an
  error;
* the procfs shows one level: NVML and we share the namespace only if the PID is one of ours *and*
  that process holds a ``/dev/nvidia*`` file open (a container-local PID that merely equals a host
  PID fails this check); anything else means the mapping is impossible;
* unreadable entries are skipped: a process that vanished mid-scan holds no memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from msgspec import Struct


class PidMap(Struct, frozen=True):
    host_to_local: Mapping[int, int]  # outermost visible PID -> PID in our namespace
    local_pids: frozenset[int]  # every PID of our namespace seen in the scan
    nested: bool  # the procfs showed an outer namespace level for our processes


class Translation(Struct, frozen=True):
    """NVML PIDs placed in our namespace; ``failed`` lists the ones that could not be placed."""

    local: Mapping[int, int]  # NVML pid -> local pid (only for processes in our namespace)
    foreign: frozenset[int]  # provably outside our namespace (another container)
    failed: frozenset[int]  # cannot tell: the mapping is impossible for these

    @property
    def ok(self) -> bool:
        return not self.failed


def nspid_fields(status_text: str) -> list[int] | None:
    """The numbers of the ``NSpid:`` line, outermost first; None when the line is missing or bad."""
    for line in status_text.splitlines():
        if line.startswith("NSpid:"):
            try:
                fields = [int(f) for f in line[len("NSpid:"):].split()]
            except ValueError:
                return None
            return fields or None
    return None


def _readlink(path: Path) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def read_pid_map(proc_root: Path) -> PidMap:
    """Scan ``proc_root`` once; entries in another PID namespace than ours are left out when the
    procfs lets us tell (``<proc_root>/self/ns/pid`` and ``<pid>/ns/pid`` readable)."""
    own_ns = _readlink(proc_root / "self" / "ns" / "pid")
    host_to_local: dict[int, int] = {}
    local: set[int] = set()
    nested = False
    try:
        entries = [e.name for e in os.scandir(proc_root) if e.name.isdigit()]
    except OSError:
        entries = []
    for name in entries:
        entry = proc_root / name
        if own_ns is not None and _readlink(entry / "ns" / "pid") != own_ns:
            continue  # another namespace (or vanished): not a process we can own
        try:
            status = (entry / "status").read_text(errors="replace")
        except OSError:
            continue
        fields = nspid_fields(status) or [int(name)]  # kernels before 4.1 have no NSpid line
        local.add(fields[-1])
        if len(fields) > 1:
            nested = True
            host_to_local[fields[0]] = fields[-1]
    return PidMap(host_to_local, frozenset(local), nested)


def holds_nvidia_device(proc_root: Path, pid: int) -> bool | None:
    """Whether the process has a ``/dev/nvidia*`` file open (every CUDA context does); None when
    its descriptors cannot be read (permissions, or it vanished)."""
    fd_dir = proc_root / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    for fd in names:
        target = _readlink(fd_dir / fd)
        if target is not None and target.startswith("/dev/nvidia"):
            return True
    return False


def translate(pids: Iterable[int], pid_map: PidMap, proc_root: Path) -> Translation:
    """Place each NVML PID in our namespace, or say why it cannot be placed (see module doc)."""
    local: dict[int, int] = {}
    foreign: set[int] = set()
    failed: set[int] = set()
    for pid in set(pids):
        if pid in pid_map.host_to_local:
            local[pid] = pid_map.host_to_local[pid]
        elif pid_map.nested:
            foreign.add(pid)
        elif pid in pid_map.local_pids and holds_nvidia_device(proc_root, pid) is not False:
            local[pid] = pid
        else:
            failed.add(pid)
    return Translation(local, frozenset(foreign), frozenset(failed))
