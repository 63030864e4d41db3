"""Holding an engine's KV-cache limit: pure decisions over what the segment was seen to hold.

The owner reads the engine's kvcached segment (when it appears, then on a short hold interval)
and hands each reading to ``on_reading``; it gets back the new state and, when the segment does
not hold what was asked, the write to make. Cases:

- a new inode: the engine (re)created its segment at full capacity; that total is its capacity,
  and the requested limit (clamped to it) is applied at once;
- the same inode with a total the agent did not write: someone else wrote it; set it back,
  count it, and report ``KVLimitNotHeld`` until a read-back shows it holds again;
- no limit requested: the agent only observes;
- the segment vanishes under the running engine (someone deleted the file): nothing is in force
  any more, so nothing is reported as applied (``lost``, condition ``KVSegmentMissing``) until
  the engine makes a new one. kvcached's write path recreates a missing file zero-filled, so a
  new segment whose ``total_size`` is 0 keeps the capacity the engine started with, and the
  limit in force before the loss (the request, or the whole capacity) is written back at once.
kvcached evicts nothing when a limit drops, so ``used`` may stay above the limit for a while;
that is reported as it is, not "fixed".

``kv_capacity_bytes`` (``in_force``) is what AIBrix's controller compares with its target: the
segment's ``total_size``, except that a limit asked above the startup capacity is reported as
in force once the segment holds that whole capacity (the segment is never written above it).
"""

from __future__ import annotations


from msgspec import Struct
from msgspec.structs import replace

from runtime_agent.kv.segment import SegmentInfo, clamp


class KvState(Struct, frozen=True):
    requested: int | None = None  # what the controller asked for
    target: int | None = None  # requested, clamped to capacity: what the agent writes
    applied: int | None = None  # what a read-back last confirmed the segment holds
    capacity: int | None = None  # total_size the segment was created with
    inode: int | None = None
    total: int | None = None  # total_size as last seen
    used: int | None = None  # used + prealloc: memory actually mapped
    present: bool = False
    not_held: bool = False
    set_back_total: int = 0
    restarted: bool = False  # a new engine process: its next segment is a fresh one
    lost: bool = False  # the segment vanished under the running engine and is not back yet


ENGINE_KV_CAPACITY = "engine_kv_capacity"


def capped_by(state: KvState) -> str | None:
    """What holds the applied limit below the requested one, or None: the engine created its
    KV cache (its kvcached segment) smaller than the limit asked, and a limit only lowers it."""
    if state.requested is not None and state.capacity is not None \
            and state.requested > state.capacity:
        return ENGINE_KV_CAPACITY
    return None


def in_force(state: KvState) -> int | None:
    """The limit in force as AIBrix's controller reads ``kv_capacity_bytes``: the segment's
    ``total_size``, or the limit asked when it is above the engine's startup capacity and the
    segment holds all of that capacity. The controller skips a model whose target equals this
    figure; reporting the clamped value would make it send the same limit on every tick."""
    if (capped_by(state) is not None and state.present and not state.not_held
            and state.total is not None and state.total == state.capacity == state.applied):
        return state.requested
    return state.total


def changed_by(before: KvState, after: KvState) -> bool:
    """Whether a kv-limit call changed anything (its answer's ``applied``): the segment's
    ``total_size`` when the call found the segment and left it; otherwise the limit waiting for
    the engine's next segment."""
    if before.present and after.present and before.inode == after.inode:
        return before.total != after.total
    return before.requested != after.requested


def new_process(state: KvState) -> KvState:
    """The engine was (re)started: forget the old segment, whatever inode the new one gets.

    tmpfs recycles inode numbers, and an engine may reset its segment in place, so an inode
    change alone cannot tell a restart; the owner knows, and says so here.
    """
    return replace(state, inode=None, capacity=None, target=None, applied=None, total=None,
                   used=None, present=False, not_held=False, lost=False,
                   restarted=state.restarted or state.inode is not None)


class Write(Struct, frozen=True):
    value: int
    expected_inode: int
    reason: str  # "initial" | "restored" | "set_back" | "requested"


def with_request(state: KvState, limit: int) -> tuple[KvState, Write | None, bool]:
    """The controller asks for ``limit``. Returns state, the write to make, and clamped?"""
    if state.capacity is None or state.inode is None or not state.present:
        return replace(state, requested=limit, target=None, applied=None), None, False
    value, clamped = clamp(limit, state.capacity)
    new = replace(state, requested=limit, target=value)
    if state.total == value and state.applied == value:
        return new, None, clamped
    return new, Write(value, state.inode, "requested"), clamped


def on_reading(state: KvState, info: SegmentInfo | None) -> tuple[KvState, Write | None]:
    if info is None:
        if state.inode is None and not state.present:
            return replace(state, present=False, used=None, total=None), None
        # It was there for this process and is gone: nothing holds a limit now, and the
        # next segment of this name is a new one, whatever inode number tmpfs gives it.
        return replace(state, present=False, used=None, total=None, applied=None, inode=None,
                       not_held=False, lost=True), None
    seen = replace(state, present=True, total=info.total_size, used=info.mapped)
    replaced = info.inode != state.inode
    if replaced or (state.capacity is None and info.total_size > 0):
        # kvcached's write path recreates a lost file zero-filled, and a reader may see a new
        # one zero-filled before its creator writes it: that 0 is no capacity
        capacity = info.total_size if info.total_size > 0 else state.capacity
        restarted = state.restarted or (replaced and state.inode is not None)
        if capacity is None or capacity <= 0:  # wait for a reading that shows one
            return replace(seen, inode=info.inode, capacity=None, target=None, applied=None,
                           not_held=False, restarted=restarted), None
        fresh = replace(seen, inode=info.inode, capacity=capacity, applied=None, not_held=False,
                        restarted=False, lost=False)
        reason = "restored" if restarted or state.lost else "initial"
        if state.requested is None:
            if state.lost and info.total_size != capacity:  # back to "no limit"
                return fresh, Write(capacity, info.inode, "restored")
            return fresh, None
        value, _ = clamp(state.requested, capacity)
        return replace(fresh, target=value), Write(value, info.inode, reason)
    if state.requested is None or state.target is None:
        if state.requested is not None and state.capacity is not None:
            value, _ = clamp(state.requested, state.capacity)
            return replace(seen, target=value), Write(value, info.inode, "initial")
        return seen, None
    if info.total_size == state.target:
        return replace(seen, applied=info.total_size, not_held=False), None
    if state.applied is None:  # never confirmed (an earlier write failed): try again
        return seen, Write(state.target, info.inode, "initial")
    return (replace(seen, not_held=True, set_back_total=state.set_back_total + 1),
            Write(state.target, info.inode, "set_back"))


def after_write(state: KvState, write: Write, readback: SegmentInfo) -> KvState:
    """What a write's read-back says: applied only when the segment holds the value."""
    held = readback.total_size == write.value and readback.inode == write.expected_inode
    return replace(state, total=readback.total_size, used=readback.mapped,
                   applied=write.value if held else None, not_held=not held)
