"""The door's per-call decisions: forward, hold (and what for) or refuse, and which claim."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.door.plan import (
    MOVE,
    RETRY_AFTER,
    ROOM,
    SETTLE,
    START,
    WAKE,
    Forward,
    Hold,
    Refuse,
    choose,
    decide,
)
from reconciler.routes import Route
from reconciler.status import ClaimStatus

pytestmark = pytest.mark.timeout(30)
KEY = ("default", "m")


def status(phase: str, ready: str = "", scheduled: str = "") -> ClaimStatus:
    st_ = ClaimStatus("default", "m", "uid", 0.0, model_name="m")
    st_.set(1.0, phase, scheduled=(False, scheduled, "why") if scheduled else None,
            ready=(phase == "Active", ready, "ready message"))
    return st_


def route(state: str = "active", port: int = 20000) -> Route:
    return Route("m", "default/m", "agent-a", "127.0.0.1", port, state, "", True)


def test_an_active_claim_on_the_route_is_forwarded_to_its_port() -> None:
    d = decide(KEY, status("Active", "ModelClaimActive"), route())
    assert d == Forward(KEY, "127.0.0.1", 20000, "agent-a")


def test_an_active_claim_off_the_route_is_held_until_it_settles() -> None:
    d = decide(KEY, status("Active", "ModelClaimActive"), route("sleeping", 0))
    assert d == Hold(KEY, SETTLE) and not d.wake and d.retry_after == 10


@pytest.mark.parametrize(("phase", "ready", "scheduled", "cause", "wake", "kick"), [
    ("Sleeping", "EngineSleeping", "Placed", WAKE, True, False),
    ("Sleeping", "WaitingForRoom", "Placed", ROOM, True, False),
    ("Activating", "EngineStarting", "Placed", START, False, False),
    ("Pending", "NotPlaced", "NoMatchingPods", ROOM, False, True),
    ("Pending", "NotPlaced", "MakingRoom", ROOM, False, True),
    ("Failed", "Moving", "Placed", MOVE, False, False),
    ("Failed", "ActivateFailed", "NoMatchingPods", START, False, True),
])
def test_a_claim_that_can_serve_later_holds_the_request(phase: str, ready: str, scheduled: str,
                                                        cause: str, wake: bool,
                                                        kick: bool) -> None:
    d = decide(KEY, status(phase, ready, scheduled), route("activating", 0))
    assert d == Hold(KEY, cause, wake=wake, kick=kick)
    assert d.retry_after == RETRY_AFTER[cause]


@pytest.mark.parametrize(("phase", "ready", "scheduled"), [
    ("Pending", "NotPlaced", "TooLargeForAnyCard"),
    ("Pending", "NotPlaced", "InvalidPerGPU"),
    ("Failed", "InvalidEngineConfig", ""),
])
def test_a_claim_held_back_for_good_is_refused_without_retry_after(phase: str, ready: str,
                                                                   scheduled: str) -> None:
    d = decide(KEY, status(phase, ready, scheduled), route("failed", 0))
    assert isinstance(d, Refuse) and d.retry_after is None
    assert "model 'm'" in d.message and (scheduled or ready) in d.message


def test_an_engine_failed_for_good_is_refused_with_retry_after() -> None:
    d = decide(KEY, status("Failed", "EngineFailed", "Placed"), route("failed", 0))
    assert isinstance(d, Refuse) and d.retry_after == 10 and "failed permanently" in d.message


def test_a_claim_not_looked_at_yet_is_held_and_kicked() -> None:
    assert decide(KEY, None, None) == Hold(KEY, START, kick=True)


A, B, C = ("default", "a"), ("default", "b"), ("default", "c")


def test_placement_prefers_the_awake_claim_with_the_fewest_requests_in_flight() -> None:
    load = {A: 3, B: 1, C: 0}
    decisions: list[Forward | Hold | Refuse] = [Forward(A, "h", 1, "x"), Forward(B, "h", 2, "x"),
                                                Hold(C, WAKE, wake=True)]
    assert choose(decisions, load.__getitem__) == Forward(B, "h", 2, "x")


def test_placement_takes_the_cheapest_to_make_servable_when_none_is_awake() -> None:
    decisions = [Hold(A, ROOM, kick=True), Hold(B, WAKE, wake=True), Hold(C, START)]
    assert choose(decisions, lambda k: 0) == Hold(C, START)
    assert choose(decisions[:2], lambda k: 0) == Hold(B, WAKE, wake=True)


def test_a_burst_at_sleeping_replicas_asks_one_wake_the_lowest_replica_not_the_least_held(
        ) -> None:
    """Held calls count as in flight on the replica they wait for: choosing by that load
    sent the next call of a burst to the other sleeping replica, and woke each."""
    zero, two, ten = ("default", "m"), ("default", "m#2"), ("default", "m#10")
    held = {zero: 5, two: 1, ten: 0}
    decisions = [Hold(k, WAKE, wake=True) for k in (ten, two, zero)]
    assert choose(decisions, held.__getitem__) == Hold(zero, WAKE, wake=True)
    assert choose(decisions[:2], held.__getitem__) == Hold(two, WAKE, wake=True)  # not m#10


def test_a_sleeping_replica_is_woken_when_replica_zero_failed_for_good() -> None:
    one = ("default", "m#1")
    decisions = [Refuse(KEY, "failed permanently", RETRY_AFTER[START]),
                 Hold(one, WAKE, wake=True)]
    assert choose(decisions, lambda k: 0) == Hold(one, WAKE, wake=True)
    assert choose([Hold(KEY, ROOM, kick=True), decisions[1]], lambda k: 0) == decisions[1]


def test_placement_refuses_only_when_every_claim_refuses() -> None:
    refusal = Refuse(A, "no", None)
    assert choose([refusal, Hold(B, MOVE)], lambda k: 0) == Hold(B, MOVE)
    assert choose([refusal], lambda k: 0) == refusal


decision_st = st.one_of(
    st.builds(Forward, st.sampled_from([A, B, C]), st.just("h"), st.integers(1, 3),
              st.just("x")),
    st.builds(Hold, st.sampled_from([A, B, C]), st.sampled_from([SETTLE, WAKE, ROOM, START, MOVE])),
    st.builds(Refuse, st.sampled_from([A, B, C]), st.just("no"), st.none()))


@given(st.lists(decision_st, min_size=1, max_size=6),
       st.dictionaries(st.sampled_from([A, B, C]), st.integers(0, 50)))
def test_placement_never_holds_when_a_claim_is_awake_and_picks_the_least_loaded(
        decisions: list[Forward | Hold | Refuse], load: dict[tuple[str, str], int]) -> None:
    chosen = choose(decisions, lambda k: load.get(k, 0))
    assert chosen in decisions
    awake = [d for d in decisions if isinstance(d, Forward)]
    if awake:
        assert isinstance(chosen, Forward)
        assert load.get(chosen.claim, 0) == min(load.get(d.claim, 0) for d in awake)
    elif any(isinstance(d, Hold) for d in decisions):
        assert isinstance(chosen, Hold)
