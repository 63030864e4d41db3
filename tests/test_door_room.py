"""The door's view of a sleeping route candidate's GPU (``reconciler.door.room``), its plans
(``Router``'s reservation book over that view), the wake request that carries its victims, and
the reconciler's sleep order that takes them first. Pure: the end-to-end path is
``tests.test_door_made_room``'s."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contract.quantity import GiB
from reconciler.desired import ClaimKey
from reconciler.door import plan
from reconciler.door.forwards import USE_HALF_LIFE_S, Forwards
from reconciler.door.room import Room, room_for
from reconciler.door.routing import Routed, Router
from reconciler.local.desired import DesiredState
from reconciler.model.policy import PoolPolicy
from reconciler.planning.sleep_policy import sleep_order, victims
from reconciler.planning.state import Candidate, EngineState, Gpu, Resident
from reconciler.routes import WakeBook
from reconciler.selection.delay import Demand
from tests.test_door_route_choice import ASLEEP_BIG, BIG, FWD_SMALL, SMALL, pick, router

pytestmark = pytest.mark.timeout(30)
NOW = 1000.0
NO_RESERVE = PoolPolicy(300, True, 30)


def res(name: str, footprint: float, idle: float | None = 60.0, **kw: object) -> Resident:
    return Resident(name, int(footprint * GiB), 1 * GiB,
                    last_busy=None if idle is None else NOW - idle, **kw)  # type: ignore[arg-type]


def card(*engines: Resident, policy: PoolPolicy = NO_RESERVE, usable: float = 15) -> Candidate:
    return Candidate("agent-a", (Gpu(0, int(usable * GiB), engines),), policy=policy)


def no_use(name: str) -> tuple[int, Demand]:
    return 0, Demand()


def test_a_sleeping_copy_needs_its_room_less_what_it_holds_asleep_and_sees_who_could_sleep(
        ) -> None:
    big = res("big", 6, state=EngineState.ASLEEP, sleeping_footprint=GiB // 2)
    a, b = res("a", 4), res("b", 4, idle=5.0, make_room_after=2.0)
    got = room_for(card(big, a, b), 0, "big", 7 * GiB, NOW, no_use, lambda m: f"default/{m}")
    assert got is not None
    assert got.needs == 7 * GiB - GiB // 2  # its room, less the half GiB charged asleep
    assert (got.gpu.id, got.gpu.usable, got.gpu.free) == ("agent-a/0", 15 * GiB,
                                                          15 * GiB - GiB // 2 - 10 * GiB)
    by_name = {o.name: o for o in got.gpu.occupants}
    assert sorted(by_name) == ["default/a", "default/b"]
    assert got.models == {"default/a": "a", "default/b": "b"}
    # each frees its charge less the 1 GiB a sleeping engine keeps when not measured yet
    assert by_name["default/a"].frees == 4 * GiB
    # idle enough from the end of its last request plus its own threshold (pool's: 30 s)
    assert by_name["default/a"].idle_since == NOW - 60 + 30
    assert by_name["default/b"].idle_since == NOW - 5 + 2


def test_only_awake_measured_vllm_engines_that_may_be_slept_for_room_are_occupants() -> None:
    engines = (res("big", 6, state=EngineState.ASLEEP), res("ollama", 2, can_sleep=False),
               res("new", 2, unmeasured=True), res("starting", 2, state=EngineState.STARTING),
               res("kept", 2, make_room_after=float("inf")), res("busy", 2, running=1.0),
               res("ok", 2))
    got = room_for(card(*engines, usable=40), 0, "big", 7 * GiB, NOW, no_use, str)
    assert got is not None
    by_name = {o.name: o for o in got.gpu.occupants}
    assert sorted(by_name) == ["busy", "kept", "ok"]
    assert by_name["kept"].idle_since is None  # never slept for room
    assert by_name["busy"].in_flight == 1 and by_name["busy"].idle_since is None
    assert by_name["ok"].idle_since is not None


def test_where_sleeping_others_frees_nothing_for_a_wake_the_gpu_has_no_occupants() -> None:
    got = room_for(card(res("big", 6, state=EngineState.ASLEEP), res("a", 4),
                        policy=PoolPolicy(60)), 0, "big", 7 * GiB, NOW, no_use, str)
    assert got is not None and got.gpu.occupants == ()
    assert got.needs == 0  # asleep, it keeps its whole room
    assert room_for(card(res("a", 4)), 3, "big", 7 * GiB, NOW, no_use, str) is None


def test_the_door_s_demand_reaches_the_occupants() -> None:
    def usage(name: str) -> tuple[int, Demand]:
        return (2, Demand(waiters=1, recent_use=3.0)) if name == "a" else (0, Demand())

    got = room_for(card(res("big", 6, state=EngineState.ASLEEP), res("a", 4)), 0, "big",
                   7 * GiB, NOW, usage, str)
    assert got is not None
    (a,) = got.gpu.occupants
    assert (a.in_flight, a.demand.waiters, a.demand.recent_use) == (2, 1, 3.0)


def test_recent_use_counts_forwards_halved_every_half_life() -> None:
    fw = Forwards()
    for t in (0.0, 0.0, 0.0, 0.0):
        fw.start(SMALL, t)
    assert fw.recent_use(SMALL, 0.0) == 4.0
    assert fw.recent_use(SMALL, USE_HALF_LIFE_S) == pytest.approx(2.0)
    fw.start(SMALL, USE_HALF_LIFE_S)
    assert fw.recent_use(SMALL, 2 * USE_HALF_LIFE_S) == pytest.approx(1.5)
    assert fw.recent_use(BIG, 5.0) == 0.0


# ---- the router's plans over that view ------------------------------------------------------

def made_room(tmp_path: Path) -> tuple[Router, DesiredState]:
    """``big`` (asleep, needs 7 GiB) on a GPU with 3 GiB free and two idle victims, ``a``
    (used) and ``b`` (not): a route with tolerance 0 over big and small."""
    occupants = room_for(card(res("big", 6, state=EngineState.ASLEEP, sleeping_footprint=0),
                              res("a", 5), res("b", 5)), 0, "big", 7 * GiB, NOW,
                         lambda m: (0, Demand(recent_use=5.0 if m == "a" else 0.0)),
                         lambda m: f"default/{m}")
    assert occupants is not None and occupants.gpu.free == 3 * GiB

    def room(key: ClaimKey, model: str) -> Room | None:
        return occupants if key == BIG else None

    r, d = router(tmp_path, {BIG: ASLEEP_BIG, SMALL: FWD_SMALL}, tolerance=0)
    r._room, r._now = room, lambda: NOW  # noqa: SLF001 (the door passes them in)
    return r, d


def test_made_room_sleeps_the_least_needed_and_claims_a_plan_until_released(
        tmp_path: Path) -> None:
    r, d = made_room(tmp_path)
    first = pick(r, d)
    assert isinstance(first, Routed)
    assert (first.kind, first.claim, first.victims) == ("made-room", BIG, ("b",))
    assert first.headers("agent-a")["x-route-slept"] == "b"
    assert [p.id for p in r.book.plans] == [first.plan_id]
    second = pick(r, d)
    # the same view again (big's wake not asked yet): b's credit is the first plan's, and a
    # alone cannot make big's 7 GiB again, so the call is held for big (it converges on it)
    assert isinstance(second, Routed) and (second.kind, second.victims, second.plan_id) == (
        "held", (), None)
    r.release(first.plan_id)
    assert r.book.plans == ()
    third = pick(r, d)
    assert isinstance(third, Routed) and third.victims == ("b",)


def test_a_plan_looked_at_without_booking_claims_nothing(tmp_path: Path) -> None:
    r, d = made_room(tmp_path)
    got = r.choose(d.routes["chat"], "chat", {"model": "chat"}, b"{}", book=False)
    assert isinstance(got, Routed) and got.victims == ("b",) and got.plan_id is None
    assert r.book.plans == ()


def test_a_plan_expires_when_no_call_releases_it(tmp_path: Path) -> None:
    r, d = made_room(tmp_path)
    first = pick(r, d)
    assert isinstance(first, Routed) and first.plan_id is not None
    r._now = lambda: NOW + 301  # noqa: SLF001 (past its 300 s)
    again = pick(r, d)
    assert isinstance(again, Routed) and again.kind == "made-room" and again.victims == ("b",)
    assert [p.id for p in r.book.plans] == [again.plan_id]


# ---- the wake request and the reconciler's order ---------------------------------------------

def test_a_repeated_wake_request_gives_its_victims_to_one_that_named_none() -> None:
    book = WakeBook()
    req, new = book.request("big", BIG, 0.0, 0.0)
    assert new and not req.victims
    again, new = book.request("big", BIG, 1.0, 1.0, ("b",))
    assert again is req and not new and list(req.victims) == ["b"]
    book.request("big", BIG, 2.0, 2.0, ("a",))
    assert list(req.victims) == ["b"]  # the first named set stays


def test_the_reconciler_sleeps_the_named_victims_first_where_they_may_be_slept() -> None:
    a, b = res("a", 4, idle=600.0), res("b", 4, idle=40.0)
    big = res("big", 6, state=EngineState.ASLEEP, sleeping_footprint=0)
    assert [e.name for e in sleep_order([a, b], NO_RESERVE, NOW)] == ["a", "b"]
    assert [e.name for e in sleep_order([a, b], NO_RESERVE, NOW, first=("b",))] == ["b", "a"]
    assert victims(15 * GiB, 7 * GiB, [big, a, b], NO_RESERVE, NOW, waking="big") == ["a"]
    assert victims(15 * GiB, 7 * GiB, [big, a, b], NO_RESERVE, NOW, waking="big",
                   first=("b",)) == ["b"]
    busy = res("b", 4, idle=None, running=1.0)  # named, but now busy: the reconciler's own
    assert victims(15 * GiB, 7 * GiB, [big, a, busy], NO_RESERVE, NOW, waking="big",
                   first=("b",)) == ["a"]


@given(st.lists(st.sampled_from("abcde"), unique=True), st.lists(
    st.floats(31, 1000), min_size=5, max_size=5))
def test_a_named_order_never_adds_an_engine_that_may_not_be_slept(first: list[str],
                                                                   idles: list[float]) -> None:
    engines = [res(n, 2, idle=i) for n, i in zip("abcde", idles, strict=True)]
    engines.append(res("f", 2, idle=1.0))  # not idle long enough
    got = [e.name for e in sleep_order(engines, NO_RESERVE, NOW, first=[*first, "f"])]
    assert sorted(got) == list("abcde") and got[:len(first)] == first


def test_a_held_route_decision_has_no_victims() -> None:
    assert Routed("chat", "held", BIG, "big").headers("a").get("x-route-slept") is None
    assert plan.Hold(BIG, plan.WAKE, wake=True).wake
