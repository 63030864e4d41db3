"""Pure KV-limit holding decisions: what a reading of the segment makes the agent write."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime_agent.kv.hold import (
    KvState,
    Write,
    after_write,
    changed_by,
    in_force,
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
    st.tuples(st.just("read"), st.just(0), st.integers(1, 3)),  # kvcached's recreated file
    st.tuples(st.just("vanish")),
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
        elif step[0] == "vanish":
            state, write = on_reading(state, None)
            assert state.applied is None and state.total is None
        else:
            state = new_process(state)
        if write is not None:
            assert state.capacity is not None and 0 < write.value <= state.capacity
            assert write.value == min(state.requested or state.capacity, state.capacity)
            state = after_write(state, write, seg(write.value, inode=write.expected_inode))
            assert state.applied == write.value


# ---- the keeper: what it reports is what the segment read back, never what it asked ----------

from pathlib import Path  # noqa: E402

from registry.record import EngineRecord, EngineSpec  # noqa: E402
from runtime_agent.cadence import Cadence, Pacer  # noqa: E402
from runtime_agent.kv.keeper import KvKeeper  # noqa: E402
from runtime_agent.kv.segment import create_segment, read_segment, write_limit  # noqa: E402
from tests.clocks import FakeClock  # noqa: E402

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


class _PacedBy(Pacer):
    """A pacer whose pause is one sleep of its whole interval on a stepped ``FakeClock``, so the
    clock's record shows the intervals it chose."""

    def __init__(self, clock: FakeClock, floor_s: float = 1.0, cap_s: float = 1.0,
                 on_pause: Callable[[int], None] = lambda n: None) -> None:
        super().__init__(Cadence(floor_s, cap_s), clock)
        self._stepped = clock
        self._on_pause = on_pause

    async def pause(self) -> None:
        self._on_pause(len(self._stepped.asked))
        await self._stepped.sleep(self.interval_s)


async def test_no_segment_is_looked_for_often_once_the_engine_is_ready_without_one(
        tmp_path: Path) -> None:
    clock = FakeClock(1000.0, stepped=True, limit=6)
    ready = False
    keeper = KvKeeper(_record(), tmp_path, lambda reason, _: None, clock=clock)

    def pauses_so_far() -> bool:
        nonlocal ready
        ready = len(clock.asked) >= 3  # boots for three looks, then serves without one
        return ready

    with pytest.raises(asyncio.CancelledError):
        await keeper.watch(lambda info, writes: None, 0.01, _PacedBy(clock), pauses_so_far)
    assert clock.asked == [0.01, 0.01, 0.01, 1.0, 1.0, 1.0]


async def test_a_segment_that_appears_while_the_engine_boots_is_read_at_once(
        tmp_path: Path) -> None:
    clock = FakeClock(1000.0, stepped=True, limit=3)
    readings: list[SegmentInfo | None] = []
    keeper = KvKeeper(_record(), tmp_path, lambda reason, _: None, clock=clock)

    def booting() -> bool:
        if len(clock.asked) == 1:
            create_segment("kvc_m", 4 * GIB, tmp_path)  # the engine sizes its cache
        return False

    with pytest.raises(asyncio.CancelledError):
        await keeper.watch(lambda info, writes: readings.append(info), 0.01, _PacedBy(clock),
                           booting)
    assert clock.asked[:2] == [0.01, 0.01] and readings and readings[0] is not None
    assert readings[0].total_size == 4 * GIB


async def test_a_steady_segment_is_read_less_often_and_a_moved_one_at_once_again(
        tmp_path: Path) -> None:
    clock = FakeClock(1000.0, stepped=True, limit=7)
    create_segment("kvc_m", 4 * GIB, tmp_path)
    keeper = KvKeeper(_record(), tmp_path, lambda reason, _: None, clock=clock)

    posted: list[SegmentInfo | None] = []

    def moves(pauses: int) -> None:
        if pauses == 4:  # the segment moves (another writer, here)
            write_limit("kvc_m", 2 * GIB, tmp_path)

    async def handle(info: SegmentInfo | None, writes: int) -> None:
        posted.append(info)
        await keeper.reading(info, writes)  # the owner's part

    def post(info: SegmentInfo | None, writes: int) -> None:
        asyncio.get_running_loop().create_task(handle(info, writes))

    with pytest.raises(asyncio.CancelledError):
        await keeper.watch(post, 0.01, _PacedBy(clock, 1.0, 4.0, moves), lambda: True)
    assert clock.asked == [1.0, 2.0, 4.0, 4.0, 4.0, 1.0, 2.0]
    # The owner hears of the first reading and of the moved one; steady ones would change
    # nothing and are not posted.
    assert [i.total_size for i in posted if i is not None] == [4 * GIB, 2 * GIB]


# ---- every field of each decision (mutation testing showed which ones nothing checked) --------

from msgspec.structs import replace  # noqa: E402

from runtime_agent.kv.segment import SegmentError, SegmentMissing, SegmentReplaced  # noqa: E402

HELD = KvState(requested=GiB, target=GiB, applied=GiB, capacity=4 * GiB, inode=7, total=GiB,
               used=0, present=True)


def test_a_request_without_a_usable_segment_is_only_remembered() -> None:
    for state in (replace(HELD, present=False), replace(HELD, capacity=None),
                  replace(HELD, inode=None)):
        assert with_request(state, 2 * GiB) == (
            replace(state, requested=2 * GiB, target=None, applied=None), None, False)


def test_a_request_the_segment_already_holds_writes_nothing() -> None:
    assert with_request(HELD, GiB) == (HELD, None, False)
    assert with_request(replace(HELD, total=3 * GiB), GiB)[1] == Write(GiB, 7, "requested")
    assert with_request(HELD, 8 * GiB) == (replace(HELD, requested=8 * GiB, target=4 * GiB),
                                           Write(4 * GiB, 7, "requested"), True)


def test_a_vanished_segment_forgets_what_it_held_but_not_the_request() -> None:
    """Nothing holds a limit once the file is gone: applied is null, not the old figure."""
    assert on_reading(HELD, None) == (replace(HELD, present=False, used=None, total=None,
                                              applied=None, inode=None, lost=True), None)


def test_a_segment_never_seen_is_not_lost_when_it_is_absent() -> None:
    waiting = KvState(requested=GiB)  # an engine without kvcached, or one still booting
    assert on_reading(waiting, None) == (waiting, None)


def test_a_zero_filled_segment_after_a_loss_keeps_the_capacity_and_gets_the_limit_back() -> None:
    lost, _ = on_reading(HELD, None)
    state, write = on_reading(lost, seg(0, inode=7, used=GiB // 2))  # kvcached's write path
    assert write == Write(GiB, 7, "restored")
    assert state == replace(HELD, applied=None, total=0, used=GiB // 2, lost=False)
    state = after_write(state, write, seg(GiB, inode=7, used=GiB // 2))
    assert state.applied == GiB and not state.not_held


def test_a_segment_recreated_at_full_size_after_a_loss_is_a_new_capacity() -> None:
    lost, _ = on_reading(HELD, None)
    state, write = on_reading(lost, seg(6 * GiB, inode=8))
    assert write == Write(GiB, 8, "restored") and state.capacity == 6 * GiB


def test_a_lost_segment_without_a_request_is_given_its_whole_capacity_back() -> None:
    observing = replace(HELD, requested=None, target=None, applied=None, total=4 * GiB)
    lost, _ = on_reading(observing, None)
    state, write = on_reading(lost, seg(0, inode=7))
    assert write == Write(4 * GiB, 7, "restored") and state.target is None
    assert on_reading(lost, seg(4 * GiB, inode=7))[1] is None  # nothing to restore


def test_a_zero_filled_segment_with_no_capacity_known_waits_for_one() -> None:
    """kvcached sizes a new file before it takes the lock that writes it: a reader in
    between sees 24 zero bytes. Nothing is written (a 0 limit is no limit) until the
    segment shows its capacity, and then the limit goes in at once."""
    for before, reason in ((KvState(requested=GiB), "initial"),
                           (KvState(requested=GiB, restarted=True), "restored"),
                           (KvState(requested=GiB, inode=2), "restored")):
        state, write = on_reading(before, seg(0, inode=3))
        assert write is None and state.capacity is None and state.target is None
        assert with_request(state, GiB)[1] is None  # a request waits for a capacity too
        state, write = on_reading(state, seg(4 * GiB, inode=3))
        assert write == Write(GiB, 3, reason) and state.capacity == 4 * GiB


def test_a_limit_above_the_startup_capacity_is_in_force_once_all_of_it_is_held() -> None:
    capped = replace(HELD, requested=8 * GiB, target=4 * GiB, applied=4 * GiB, total=4 * GiB)
    assert in_force(capped) == 8 * GiB  # what AIBrix's controller compares with its target
    assert in_force(HELD) == GiB  # below the capacity: the segment's figure
    assert in_force(replace(capped, applied=None)) == 4 * GiB  # not confirmed yet
    assert in_force(replace(capped, not_held=True)) == 4 * GiB  # someone else wrote it
    assert in_force(replace(capped, total=3 * GiB)) == 3 * GiB
    assert in_force(replace(capped, present=False, total=None)) is None  # gone


def test_a_call_changed_something_only_when_the_segment_or_the_waiting_limit_moved() -> None:
    capped = replace(HELD, requested=8 * GiB, target=4 * GiB, applied=4 * GiB, total=4 * GiB)
    full = replace(HELD, requested=None, target=None, total=4 * GiB, applied=None)
    assert changed_by(full, capped) is False  # 8 GiB asked of a 4 GiB cache that is all free
    assert changed_by(HELD, capped) is True  # 1 GiB -> 4 GiB
    assert changed_by(HELD, HELD) is False
    waiting = KvState(requested=GiB)
    assert changed_by(KvState(), waiting) is True  # remembered for the segment to come
    assert changed_by(waiting, waiting) is False
    assert changed_by(replace(HELD, present=False), replace(HELD, requested=2 * GiB)) is True


def test_a_reading_records_total_and_mapped_bytes() -> None:
    state, write = on_reading(HELD, SegmentInfo(GiB, 100, 20, inode=7))
    assert write is None and state == replace(HELD, total=GiB, used=120)


def test_a_fresh_segment_starts_with_nothing_applied_and_nothing_wrong() -> None:
    stale = replace(HELD, not_held=True, restarted=True)
    state, write = on_reading(stale, seg(6 * GiB, inode=9))
    assert write == Write(GiB, 9, "restored")
    assert state == replace(HELD, inode=9, capacity=6 * GiB, total=6 * GiB, applied=None,
                            not_held=False, restarted=False)
    observing = replace(stale, requested=None, target=None)
    state, write = on_reading(observing, seg(6 * GiB, inode=9))
    assert write is None and state == replace(observing, inode=9, capacity=6 * GiB,
                                              total=6 * GiB, applied=None, not_held=False,
                                              restarted=False)


def test_a_request_known_before_its_target_is_written_once_the_segment_is_seen() -> None:
    pending = replace(HELD, requested=8 * GiB, target=None, applied=None)
    state, write = on_reading(pending, seg(4 * GiB))
    assert write == Write(4 * GiB, 7, "initial")  # clamped to the capacity
    assert state == replace(pending, target=4 * GiB, total=4 * GiB)
    unknown = replace(pending, capacity=None)  # first seen zero-filled: learnt now
    assert on_reading(unknown, seg(4 * GiB)) == (replace(pending, target=4 * GiB,
                                                         total=4 * GiB),
                                                 Write(4 * GiB, 7, "initial"))
    assert on_reading(unknown, seg(0)) == (replace(unknown, total=0), None)


def test_a_segment_that_holds_the_target_is_applied_and_held() -> None:
    unsure = replace(HELD, applied=None, not_held=True, total=3 * GiB)
    assert on_reading(unsure, seg(GiB)) == (replace(HELD, not_held=False), None)


def test_a_target_never_confirmed_is_written_again_as_initial() -> None:
    unsure = replace(HELD, applied=None)
    assert on_reading(unsure, seg(3 * GiB)) == (replace(unsure, total=3 * GiB),
                                                Write(GiB, 7, "initial"))


def test_a_read_back_records_what_the_segment_holds() -> None:
    write = Write(GiB, 7, "requested")
    assert after_write(HELD, write, SegmentInfo(GiB, 5, 6, inode=7)) == replace(
        HELD, total=GiB, used=11, applied=GiB, not_held=False)
    assert after_write(HELD, write, SegmentInfo(GiB, 5, 6, inode=8)) == replace(
        HELD, total=GiB, used=11, applied=None, not_held=True)  # another segment took it


class _Writer:
    """The segment write as a test wants it to end; ``calls`` in order."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls: list[tuple[str, int, int | None]] = []

    def __call__(self, name: str, value: int, shm: Path, inode: int | None) -> SegmentInfo:
        self.calls.append((name, value, inode))
        if self.error is not None:
            raise self.error
        return SegmentInfo(value, 0, 0, inode or 0)


async def _keeper_at(tmp_path: Path, writer: _Writer) -> tuple[KvKeeper, list[str]]:
    events: list[str] = []
    keeper = KvKeeper(_record(), tmp_path, lambda reason, _: events.append(reason), writer=writer)
    await keeper.reading(seg(4 * GIB, inode=7))
    return keeper, events


async def test_the_keeper_writes_to_the_inode_it_saw_and_counts_every_write(
        tmp_path: Path) -> None:
    writer = _Writer()
    keeper, events = await _keeper_at(tmp_path, writer)
    assert keeper.writes == 0
    await keeper.request(GIB)
    assert writer.calls == [("kvc_m", GIB, 7)] and keeper.writes == 1
    writer.error = SegmentError("boom", "/dev/shm/kvc_m")
    await keeper.request(2 * GIB)
    assert keeper.writes == 2  # a failed write still makes older readings stale


async def test_a_failed_write_is_counted_and_logged(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    keeper, events = await _keeper_at(tmp_path, _Writer(OSError(5, "EIO")))
    detail = await keeper.request(GIB)
    assert detail["in_force"] is False
    assert keeper._record.op_counts == {"kv_limit:failed": 2}  # the write, then the answer
    assert [r.getMessage() for r in caplog.records] == [
        "kv limit write for m failed: [Errno 5] EIO"]


async def test_a_segment_gone_or_replaced_under_a_write_is_not_a_failure(tmp_path: Path) -> None:
    keeper, _ = await _keeper_at(tmp_path, _Writer(SegmentMissing("/dev/shm/kvc_m")))
    await keeper.request(GIB)
    assert keeper.state.present is False and keeper._record.op_counts == {"kv_limit:pending": 1}
    keeper, _ = await _keeper_at(tmp_path, _Writer(SegmentReplaced("/dev/shm/kvc_m", 7, 8)))
    await keeper.request(GIB)
    assert keeper.state.present is True  # the next reading sees the new segment
    assert keeper._record.op_counts == {"kv_limit:failed": 1}


async def test_a_reading_says_whether_the_record_must_be_written(tmp_path: Path) -> None:
    writer = _Writer()
    keeper = KvKeeper(_record(), tmp_path, lambda reason, _: None, writer=writer)
    assert await keeper.reading(seg(4 * GIB, inode=7)) is True  # capacity and inode learned
    assert await keeper.reading(seg(4 * GIB, inode=7)) is False  # nothing new
    await keeper.request(GIB)
    assert await keeper.reading(seg(3 * GIB, inode=7), keeper.writes - 1) is False  # stale
    assert writer.calls == [("kvc_m", GIB, 7)]
    # Set back: a write, but what is durable (capacity, inode, applied) did not change.
    assert await keeper.reading(seg(3 * GIB, inode=7), keeper.writes) is False
    assert writer.calls[-1] == ("kvc_m", GIB, 7) and keeper.state.set_back_total == 1


async def test_each_kind_of_write_is_counted_and_reported_by_its_own_reason(
        tmp_path: Path) -> None:
    events: list[tuple[str, str]] = []
    keeper = KvKeeper(_record(), tmp_path, lambda reason, message: events.append((reason, message)),
                      writer=_Writer())
    await keeper.request(GIB)
    await keeper.reading(seg(4 * GIB, inode=7))  # the initial write
    await keeper.reading(seg(3 * GIB, inode=7))  # someone else's: set back
    keeper.new_process()
    await keeper.reading(seg(4 * GIB, inode=9))  # the restarted engine's: restored
    assert events == [
        ("KVLimitSet", f"{GIB} bytes (initial); segment holds {GIB}, uses 0"),
        ("KVLimitSetBack", f"{GIB} bytes (set_back); segment holds {GIB}, uses 0"),
        ("KVLimitRestored", f"{GIB} bytes (restored); segment holds {GIB}, uses 0")]
    assert keeper._record.op_counts == {"kv_limit:pending": 1, "kv_limit:set_back": 1,
                                        "kv_limit:restored": 1}


def test_a_new_process_forgets_the_old_segment_but_keeps_the_request() -> None:
    stale = replace(HELD, not_held=True, set_back_total=2)
    assert new_process(stale) == KvState(requested=GiB, set_back_total=2, restarted=True)
    assert new_process(KvState(requested=GiB)).restarted is False  # no segment seen yet


async def test_a_gone_engines_segment_is_removed_only_if_it_is_the_one_seen(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen = create_segment("kvc_m", 4 * GIB, tmp_path)
    keeper = KvKeeper(_record(), tmp_path, lambda reason, _: None)
    await keeper.reading(read_segment("kvc_m", tmp_path))
    newer = create_segment("kvc_m", 4 * GIB, tmp_path)  # another engine's, same name (the
    await keeper.remove_leftover()  # ... old inode was still linked: the inodes differ)
    assert read_segment("kvc_m", tmp_path) == newer and newer.inode != seen.inode

    keeper = KvKeeper(_record(), tmp_path, lambda reason, _: None)
    await keeper.reading(read_segment("kvc_m", tmp_path))
    await keeper.request(GIB)
    await keeper.remove_leftover()
    assert not (tmp_path / "kvc_m").exists()
    assert keeper.state == KvState(requested=GIB, target=GIB, capacity=4 * GIB,
                                   inode=newer.inode)
    newer = create_segment("kvc_m", 4 * GIB, tmp_path)

    never = KvKeeper(_record(), tmp_path, lambda reason, _: None)  # saw no segment at all
    never.state = replace(never.state, present=True, used=1, total=2, applied=3)
    await never.remove_leftover()
    assert read_segment("kvc_m", tmp_path) == newer
    assert (never.state.present, never.state.used, never.state.total,
            never.state.applied) == (False, None, None, None)

    (tmp_path / "file").write_text("")  # its directory cannot be read: logged, state cleared
    broken = KvKeeper(_record(), tmp_path / "file", lambda reason, _: None)
    broken.state = replace(broken.state, inode=newer.inode, present=True, used=1, total=2,
                           applied=3)
    await broken.remove_leftover()
    assert (broken.state.present, broken.state.used, broken.state.total,
            broken.state.applied) == (False, None, None, None)
    assert [r.getMessage().split(": [Errno")[0] for r in caplog.records] == [
        "could not remove kv segment of m"]


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
