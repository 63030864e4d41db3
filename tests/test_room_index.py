"""The room index: its choice is ``place``'s whenever a candidate fits, and None otherwise."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from contract.quantity import GiB
from reconciler.model.policy import PoolPolicy
from reconciler.model.selector import LabelSelector
from reconciler.planning.placement import ClaimNeed, Placed, place
from reconciler.planning.room_index import RoomIndex, kth_rooms
from reconciler.planning.state import Candidate, EngineState, Gpu, Resident
from tests.test_reconciler_planning_placement import (
    NO_RESERVE,
    NOW,
    POOL_LABELS,
    agent,
    card,
    engine,
    need,
)

ART = "huggingface://Qwen/Qwen3-0.6B"


def indexed(*cands: Candidate) -> RoomIndex:
    index = RoomIndex()
    for c in cands:
        index.put(c)
    return index


def test_kth_rooms_lists_each_gpus_room_roomiest_first() -> None:
    a = agent("a", card(16, engine("x", 6, 1), index=0), card(16, index=1),
              card(10, engine("y", 2, 1), index=2))
    assert kth_rooms(a) == [16 * GiB, 9 * GiB, 7 * GiB]


def test_it_takes_the_roomiest_agent_and_names_break_ties() -> None:
    a = agent("a", card(16, engine("x", 6, 1)))
    b = agent("b", card(16))
    c = agent("c", card(16))
    index = indexed(a, c, b)
    assert index.best(need(), NOW) == Placed("b", (0,), 9 * GiB)


def test_fewer_models_awake_beats_more_room() -> None:
    busy = agent("busy", card(80, engine("x", 2, 1)))
    asleep = agent("asleep", card(16, engine("y", 6, 1, state=EngineState.ASLEEP)))
    got = indexed(busy, asleep).best(need(2, 1), NOW)
    assert got is not None and got.agent == "asleep"


def test_an_agent_that_served_the_artifact_comes_first_even_with_less_room() -> None:
    far = agent("a", card(80))
    near = agent("b", card(16, engine("x", 6, 1)), cached_artifacts=frozenset({ART}))
    assert indexed(far, near).best(need(artifact=ART), NOW) == Placed("b", (0,), 2 * GiB)
    # hf:// names the same artifact
    assert indexed(far, near).best(need(artifact="hf://Qwen/Qwen3-0.6B"), NOW) is not None


def test_a_served_agent_without_room_does_not_win() -> None:
    far = agent("a", card(80))
    full = agent("b", card(8, engine("x", 6, 1)), cached_artifacts=frozenset({ART}))
    got = indexed(far, full).best(need(artifact=ART), NOW)
    assert got is not None and got.agent == "a"


def test_none_when_nothing_fits_and_place_says_why() -> None:
    a = agent("a", card(8))
    index = indexed(a)
    assert index.best(need(), NOW) == Placed("a", (0,), GiB)
    assert index.best(need(8), NOW) is None
    assert index.best(ClaimNeed("c", LabelSelector(), None, None), NOW) is None


def test_a_claim_reads_only_its_namespace_and_selector_and_available_agents() -> None:
    other_ns = agent("a", card(80), namespace="other")
    other_pool = agent("b", card(80), labels={"claim.model.aibrix.ai/enabled": "true"})
    sick = agent("c", card(80), healthy=False)
    stale = agent("d", card(80), observed_at=NOW - 31)
    off = agent("e", card(80), labels={"claim.model.aibrix.ai/pool": "pool-a"})
    moving = agent("f", card(80))
    ok = agent("g", card(16))
    index = indexed(other_ns, other_pool, sick, stale, off, moving, ok)
    assert index.best(need(exclude=frozenset({"f"})), NOW) == Placed("g", (0,), 9 * GiB)


def test_gpu_counts_must_match_for_all_gpu_claims_and_suffice_otherwise() -> None:
    two = agent("two", card(16, index=0), card(16, engine("x", 6, 1), index=1))
    one = agent("one", card(80))
    index = indexed(two, one)
    assert index.best(need(gpus=2), NOW) == Placed("two", (0, 1), 2 * GiB)
    got = index.best(need(gpus=1, all_gpus=False), NOW)
    assert got == Placed("one", (0,), 73 * GiB)
    assert index.best(need(12, 1, gpus=1, all_gpus=False), NOW) == Placed("one", (0,), 67 * GiB)
    assert index.best(need(gpus=3, all_gpus=False), NOW) is None


def test_put_replaces_and_drop_forgets() -> None:
    a = agent("a", card(16), cached_artifacts=frozenset({ART}))
    index = indexed(a)
    full = agent("a", card(16, engine("x", 12, 1)))
    index.put(full)
    assert index.best(need(artifact=ART), NOW) is None
    assert len(index) == 1 and "a" in index and list(index) == ["a"]
    assert index.get("a") is full
    index.drop("a")
    index.drop("a")  # twice is fine
    assert len(index) == 0 and index.best(need(), NOW) is None
    assert not index._lists and not index._levels and not index._counts and not index._served
    index.put(a)
    assert index.best(need(artifact=ART), NOW) == Placed("a", (0,), 9 * GiB)


# ---- the index against the exhaustive scan ---------------------------------------------------

ARTS = ("huggingface://m/a", "hf://m/b", "s3://bucket/c/")
POLICIES = (PoolPolicy(), NO_RESERVE)


@st.composite
def residents(draw: st.DrawFn, i: int) -> Resident:
    state = draw(st.sampled_from(list(EngineState)))
    return Resident(f"e{i}", draw(st.integers(1, 8)) * GiB, draw(st.integers(1, 3)) * GiB, state,
                    kv_used=draw(st.sampled_from([None, 0, 2 * GiB])),
                    sleeping_footprint=draw(st.sampled_from([None, GiB])))


@st.composite
def candidates(draw: st.DrawFn, name: str) -> Candidate:
    count = draw(st.integers(0, 3))
    gpus = []
    for index in range(count):
        engines = tuple(draw(residents(index * 10 + j)) for j in range(draw(st.integers(0, 3))))
        gpus.append(Gpu(index, draw(st.sampled_from([8, 16, 24])) * GiB, engines,
                        draw(st.sampled_from([0, GiB]))))
    labels = dict(POOL_LABELS)
    if draw(st.integers(0, 9)) == 0:
        labels["claim.model.aibrix.ai/enabled"] = "false"
    if draw(st.integers(0, 9)) == 0:
        labels["claim.model.aibrix.ai/pool"] = "pool-b"
    return Candidate(
        name, tuple(gpus), labels, draw(st.sampled_from(["default", "default", "other"])),
        healthy=draw(st.integers(0, 9)) > 0,
        cached_artifacts=frozenset(draw(st.lists(st.sampled_from(ARTS), max_size=2))),
        policy=draw(st.sampled_from(POLICIES)),
        observed_at=draw(st.sampled_from([None, NOW - 1, NOW - 40])),
        foreign_engines=("x",) if draw(st.integers(0, 14)) == 0 else ())


@st.composite
def needs(draw: st.DrawFn) -> ClaimNeed:
    gpus = draw(st.integers(1, 3))
    return need(draw(st.integers(1, 14)), draw(st.integers(1, 3)), gpus,
                draw(st.booleans()), artifact=draw(st.sampled_from(ARTS + ("hf://m/a/", ""))),
                exclude=frozenset(draw(st.lists(st.sampled_from(["p0", "p1"]), max_size=1))))


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 12).flatmap(
    lambda n: st.tuples(*(candidates(f"p{i}") for i in range(n)))), st.lists(needs(), min_size=1,
                                                                            max_size=4),
    st.data())
def test_the_index_chooses_what_the_exhaustive_scan_chooses(
        pool: tuple[Candidate, ...], claims: list[ClaimNeed], data: st.DataObject) -> None:
    """Ties included (cards of equal sizes, equal engines), through puts that replace agents
    with their state after a placement, as the reconciler files them."""
    index = indexed(*pool)
    current = {c.name: c for c in pool}
    for i, claim in enumerate(claims):
        want = place(claim, list(current.values()), NOW)
        got = index.best(claim, NOW)
        assert got == (want if isinstance(want, Placed) else None)
        if isinstance(want, Placed) and claim.footprint and claim.kv_floor:
            state = data.draw(st.sampled_from(list(EngineState)))
            moved = current[want.agent].with_resident(
                Resident(f"new{i}", claim.footprint, claim.kv_floor, state),
                want.devices)
            current[moved.name] = moved
            index.put(moved)
        leave: bool = data.draw(st.booleans())
        if current and leave:
            gone = data.draw(st.sampled_from(sorted(current)))
            del current[gone]
            index.drop(gone)
