"""Whose KV segment a name is: a claim marker beside the segment, taken with ``O_CREAT|O_EXCL``.

Every agent on a machine, and anything else, shares one ``/dev/shm``. Without a claim an
``ipc_name`` naming someone else's file destroyed it (the engine was told to use it and wrote
over it, and the agent unlinked it at deactivate as "made after our spawn"), and two agents
with the same model set each other's segments back every second (``KVLimitSetBack``). So:

* before any engine is started, the agent claims the name: ``<shm_dir>/<ipc_name>.owner`` is
  created with ``O_EXCL`` (``.`` is never in a kvcached name, so no segment can be called that)
  and names the agent's state directory, its PID and the engine id. Two agents racing for a
  name cannot both create it;
* a segment that already exists when the claim is taken was not made by an engine of ours:
  the claim is given back and the activation refused (409), so the engine never writes to it
  and the agent never removes it;
* the marker's inode goes into the engine's registry record (``kv_owner_inode``), beside the
  segment's (``kv_inode``); an agent restart proves its ownership by that inode and the engine
  id the marker names (tmpfs reuses inode numbers), and every write and removal is made only
  while the marker is still the recorded one;
* a marker naming the agent's own state directory but an engine it no longer has is its own
  leftover (one agent per state directory: ``runtime_agent.statelock``) and is taken over; one
  naming the very engine being claimed for (re-adopted with a record rebuilt from its process)
  is that engine's claim, kept.

Neither kvcached nor the simulated engine knows of the marker: kvcached opens an existing
segment with ``O_CREAT`` and resets it in place (same inode), the simulator replaces it with a
new inode; both are the agent's own engine writing its own segment once the claim is held.
Blocking file I/O on tmpfs (microseconds); no lock is held across it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from runtime_agent.kv.segment import segment_path

MARKER_SUFFIX = ".owner"
_MARKER_MAX = 4096


class NameTaken(Exception):
    """The name is another's: the message names the file and who holds it."""


def marker_path(ipc_name: str, shm_dir: str | os.PathLike[str]) -> str:
    return segment_path(ipc_name, shm_dir) + MARKER_SUFFIX


def _holder(path: str) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        data = os.read(fd, _MARKER_MAX)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        found = json.loads(data)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _inode(path: str) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None


def _unlink_if(path: str, inode: int) -> None:
    if _inode(path) == inode:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def claim(ipc_name: str, shm_dir: str | os.PathLike[str], state_dir: str, engine_id: str,
          ours: Callable[[str], bool], segment_inode: int | None = None) -> int:
    """Claim ``ipc_name`` for ``engine_id``; the marker's inode, or NameTaken saying why not.

    ``ours(engine_id)``: whether an engine id a marker of this state directory names is still
    one of this agent's engines (then the name is in use here). ``segment_inode``: the inode
    of a segment this agent's record proves its own (a re-adopted engine's); any other
    segment already there refuses the claim."""
    marker = marker_path(ipc_name, shm_dir)
    segment = segment_path(ipc_name, shm_dir)
    body = json.dumps({"state_dir": state_dir, "pid": os.getpid(), "engine_id": engine_id})
    for _attempt in range(3):
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            holder = _holder(marker) or {}
            inode = _inode(marker)
            if holder.get("state_dir") == state_dir and inode is not None:
                if holder.get("engine_id") == engine_id:
                    return inode  # this engine's own claim (its record rebuilt, or lost it)
                if not ours(str(holder.get("engine_id"))):
                    _unlink_if(marker, inode)  # our leftover: no other agent has our state dir
                    continue
            who = (f"the agent with state directory {holder.get('state_dir')!r} (pid "
                   f"{holder.get('pid')})" if holder else "another process")
            raise NameTaken(f"ipc_name {ipc_name!r} is claimed by {who}: {marker} says another "
                            "process owns this KV segment name; pass a distinct ipc_name")
        try:
            os.write(fd, body.encode())
            inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        found = _inode(segment)
        if found is not None and found != segment_inode:
            _unlink_if(marker, inode)
            raise NameTaken(f"ipc_name {ipc_name!r} names {segment}, which already exists and "
                            "is not a segment of an engine of this agent: another process owns "
                            "it. Pass a distinct ipc_name (or remove the file if nothing uses "
                            "it); the agent neither writes to it nor removes it")
        return inode
    raise NameTaken(f"ipc_name {ipc_name!r}: {marker} kept changing while it was claimed")


def holds(ipc_name: str, shm_dir: str | os.PathLike[str], marker_inode: int | None,
          engine_id: str) -> bool:
    """The agent still holds the name for ``engine_id``: the marker is the one its record
    names, and names that engine (tmpfs reuses inode numbers, so the inode alone is not
    proof). A record from before claims (``None``) holds it as it always did."""
    if marker_inode is None:
        return True
    path = marker_path(ipc_name, shm_dir)
    holder = _holder(path)
    return (_inode(path) == marker_inode and holder is not None
            and holder.get("engine_id") == engine_id)


def release(ipc_name: str, shm_dir: str | os.PathLike[str], marker_inode: int | None) -> None:
    """Give the name back: remove the marker, only if it is still ours."""
    if marker_inode is not None:
        _unlink_if(marker_path(ipc_name, shm_dir), marker_inode)
