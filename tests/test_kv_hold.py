"""Pure KV-limit holding decisions: what a reading of the segment makes the agent write."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime_agent.kv.hold import (
    KvState,
    Write,
    after_write,
    new_process,
    on_reading,
    with_request,
)
from runtime_agent.kv.segment import SegmentInfo

GiB = 2**30


def seg(total: int, inode: int = 7, used: int = 0) -> SegmentInfo:
    return SegmentInfo(total_size=total, used_size=used, prealloc_size=0, inode=inode)


def test_a_new_segment_records_its_capacity_and_gets_the_requested_limit() -> None:
    state, write, _ = with_request(KvState(), GiB)
    assert write is None and state.requested == GiB
    state, write = on_reading(state, seg(4 * GiB))
    assert state.capacity == 4 * GiB and write == Write(GiB, 7, "initial")
    state = after_write(state, write, seg(GiB))
    assert state.applied == GiB and not state.not_held


def test_without_a_request_the_agent_only_observes() -> None:
    state, write = on_reading(KvState(), seg(4 * GiB, used=GiB))
    assert write is None and state.used == GiB and state.applied is None


def test_an_outside_write_is_set_back_and_counted() -> None:
    state, _, _ = with_request(KvState(), GiB)
    state, write = on_reading(state, seg(4 * GiB))
    state = after_write(state, write, seg(GiB))
    state, write = on_reading(state, seg(3 * GiB))
    assert write == Write(GiB, 7, "set_back")
    assert state.not_held and state.set_back_total == 1
    state = after_write(state, write, seg(GiB))
    assert not state.not_held and state.applied == GiB


def test_a_write_the_segment_does_not_take_is_not_applied() -> None:
    state, _, _ = with_request(KvState(), GiB)
    state, write = on_reading(state, seg(4 * GiB))
    state = after_write(state, write, seg(4 * GiB))
    assert state.applied is None and state.not_held


def test_a_restarted_engine_gets_its_limit_restored_even_with_a_recycled_inode() -> None:
    state, _, _ = with_request(KvState(), GiB)
    state, write = on_reading(state, seg(4 * GiB))
    state = new_process(after_write(state, write, seg(GiB)))
    state, write = on_reading(state, seg(4 * GiB, inode=7))  # same inode number again
    assert write == Write(GiB, 7, "restored") and state.capacity == 4 * GiB
    assert state.set_back_total == 0


def test_a_vanished_segment_is_reported_absent() -> None:
    state, write = on_reading(KvState(present=True, used=5), None)
    assert write is None and not state.present and state.used is None


def test_a_request_above_capacity_is_clamped() -> None:
    state, _ = on_reading(KvState(), seg(2 * GiB))
    state, write, clamped = with_request(state, 8 * GiB)
    assert clamped and write == Write(2 * GiB, 7, "requested")


@given(st.lists(st.one_of(
    st.tuples(st.just("request"), st.integers(1, 8 * GiB)),
    st.tuples(st.just("read"), st.integers(1, 8 * GiB), st.integers(1, 3)),
    st.tuples(st.just("restart")),
), max_size=30))
def test_the_agent_never_writes_above_the_capacity_or_to_a_stale_inode(steps: list) -> None:
    state = KvState()
    for step in steps:
        write = None
        if step[0] == "request":
            state, write, _ = with_request(state, step[1])
        elif step[0] == "read":
            info = seg(step[1], inode=step[2])
            state, write = on_reading(state, info)
            if write is not None:
                assert write.expected_inode == info.inode
        else:
            state = new_process(state)
        if write is not None:
            assert state.capacity is not None and 0 < write.value <= state.capacity
            assert write.value == min(state.requested or 0, state.capacity)
            state = after_write(state, write, seg(write.value, inode=write.expected_inode))
            assert state.applied == write.value


# ---- the keeper: what it reports is what the segment read back, never what it asked ----------

from pathlib import Path  # noqa: E402

from registry.record import EngineRecord, EngineSpec  # noqa: E402
from runtime_agent.kv.keeper import KvKeeper  # noqa: E402
from runtime_agent.kv.segment import create_segment, read_segment, write_limit  # noqa: E402

pytestmark = pytest.mark.loop_guard  # the in-process core must not block its loop

GIB = 1 << 30


def _record() -> EngineRecord:
    spec = EngineSpec(model_name="m", artifact_url="hf://o/m", ipc_name="kvc_m")
    return EngineRecord(engine_id="ab" * 8, spec=spec, port=20000)


async def test_a_limit_is_in_force_only_when_the_read_back_shows_it(tmp_path: Path) -> None:
    create_segment("kvc_m", 4 * GIB, tmp_path)
    events: list[str] = []

    def engine_resets_it(name: str, value: int, shm: Path, inode: int | None) -> SegmentInfo:
        write_limit(name, value, shm, inode)  # the write lands ...
        return write_limit(name, 4 * GIB, shm, inode)  # ... and is undone before the read-back

    keeper = KvKeeper(_record(), tmp_path, lambda reason, _: events.append(reason),
                      writer=engine_resets_it)
    await keeper.reading(read_segment("kvc_m", tmp_path))
    detail = await keeper.request(GIB)
    assert detail["in_force"] is False and detail["applied_bytes"] is None
    assert events[-1] == "KVLimitNotHeld"
    honest = KvKeeper(_record(), tmp_path, lambda reason, _: events.append(reason))
    await honest.reading(read_segment("kvc_m", tmp_path))
    detail = await honest.request(GIB)
    assert detail["in_force"] is True and detail["applied_bytes"] == GIB


async def test_a_reading_taken_before_the_agents_own_write_is_not_taken_for_an_outside_one(
        tmp_path: Path) -> None:
    create_segment("kvc_m", 4 * GIB, tmp_path)
    events: list[str] = []
    keeper = KvKeeper(_record(), tmp_path, lambda reason, _: events.append(reason))
    await keeper.reading(read_segment("kvc_m", tmp_path), keeper.writes)
    stale_writes, stale = keeper.writes, read_segment("kvc_m", tmp_path)  # read: 4 GiB
    await keeper.request(GIB)  # the agent's own write lands after that read
    await keeper.reading(stale, stale_writes)  # arrives late, still showing 4 GiB
    assert keeper.state.set_back_total == 0 and "KVLimitSetBack" not in events
    await keeper.reading(read_segment("kvc_m", tmp_path), keeper.writes)
    assert keeper.state.applied == GIB and not keeper.state.not_held


async def test_an_engine_dead_before_any_reading_leaves_no_segment_but_others_stay(
        tmp_path: Path) -> None:
    import time

    before = KvKeeper(_record(), tmp_path, lambda *_: None)
    create_segment("kvc_m", 4 * GIB, tmp_path)  # made before the spawn: not this engine's
    before.new_process(time.time() + 1)  # (a spawn after the segment was made)
    await before.remove_leftover()
    assert (tmp_path / "kvc_m").exists()

    keeper = KvKeeper(_record(), tmp_path, lambda *_: None)
    keeper.new_process(time.time())
    create_segment("kvc_m", 4 * GIB, tmp_path)  # the engine makes it and dies unread
    assert keeper.state.inode is None
    await keeper.remove_leftover()
    assert not (tmp_path / "kvc_m").exists()

    adopted = KvKeeper(_record(), tmp_path, lambda *_: None)  # spawn time unknown: kept
    create_segment("kvc_m", 4 * GIB, tmp_path)
    await adopted.remove_leftover()
    assert (tmp_path / "kvc_m").exists()
