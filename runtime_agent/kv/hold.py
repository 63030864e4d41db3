"""Holding an engine's KV-cache limit: pure decisions over what the segment was seen to hold.

The owner reads the engine's kvcached segment (when it appears, then on a short hold interval)
and hands each reading to ``on_reading``; it gets back the new state and, when the segment does
not hold what was asked, the write to make. Cases:

- a new inode: the engine (re)created its segment at full capacity; that total is its capacity,
  and the requested limit (clamped to it) is applied at once;
- the same inode with a total the agent did not write: someone else wrote it; set it back,
  count it, and report ``KVLimitNotHeld`` until a read-back shows it holds again;
- no limit requested: the agent only observes.
kvcached evicts nothing when a limit drops, so ``used`` may stay above the limit for a while;
that is reported as it is, not "fixed".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from runtime_agent.kv.segment import SegmentInfo, clamp


@dataclass(frozen=True)
class KvState:
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


ENGINE_KV_CAPACITY = "engine_kv_capacity"


def capped_by(state: KvState) -> str | None:
    """What holds the applied limit below the requested one, or None: the engine created its
    KV cache (its kvcached segment) smaller than the limit asked, and a limit only lowers it."""
    if state.requested is not None and state.capacity is not None \
            and state.requested > state.capacity:
        return ENGINE_KV_CAPACITY
    return None


def new_process(state: KvState) -> KvState:
    """The engine was (re)started: forget the old segment, whatever inode the new one gets.

    tmpfs recycles inode numbers, and an engine may reset its segment in place, so an inode
    change alone cannot tell a restart; the owner knows, and says so here.
    """
    return replace(state, inode=None, capacity=None, target=None, applied=None, total=None,
                   used=None, present=False, not_held=False,
                   restarted=state.restarted or state.inode is not None)


@dataclass(frozen=True)
class Write:
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
        return replace(state, present=False, used=None, total=None), None
    seen = replace(state, present=True, total=info.total_size, used=info.mapped)
    if info.inode != state.inode:
        capacity = info.total_size
        fresh = replace(seen, inode=info.inode, capacity=capacity, applied=None, not_held=False)
        if state.requested is None:
            return replace(fresh, restarted=False), None
        value, _ = clamp(state.requested, capacity)
        reason = "restored" if state.inode is not None or state.restarted else "initial"
        return replace(fresh, target=value, restarted=False), Write(value, info.inode, reason)
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
