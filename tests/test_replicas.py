"""Replicas of a claim (issue 25, ``reconciler.replicas``): the pure parts. Keys and names, the
claim's summary of its replicas, placement apart, the parser and the change rule, and the
desired state's view of a replica."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.cli import describe
from reconciler.desired import Lookups
from reconciler.door import plan
from reconciler.model.changes import take_change
from reconciler.model.manifests import parse_manifests
from reconciler.planning.placement import Placed, Unplaced, place
from reconciler.replicas import (
    MAX_REPLICAS,
    base_key,
    index_of,
    is_replica,
    model_of_route,
    ready_count,
    replica_key,
    replica_keys,
    route_name,
    split,
    summary_phase,
    surplus,
)
from reconciler.status import ACTIVE, ACTIVATING, PENDING, SLEEPING, ClaimStatus
from reconciler.store import StatusStore
from tests.reconciler_fakes import claim_yaml
from tests.test_reconciler_planning_placement import NOW, agent, card, need

pytestmark = pytest.mark.timeout(60)
PHASES = ["Pending", "Activating", "Active", "Sleeping", "Failed"]
NAMES = st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,20}[a-z0-9])?", fullmatch=True)


# ---- keys and names ---------------------------------------------------------------------------


@given(NAMES, st.integers(0, MAX_REPLICAS - 1))
def test_a_replica_key_splits_back_into_its_claim_and_index(name: str, index: int) -> None:
    key = replica_key(("ns", name), index)
    assert base_key(key) == ("ns", name) and index_of(key) == index
    assert is_replica(key) == (index > 0)
    assert split(key[1]) == (name, index)


@given(NAMES)
def test_no_claim_name_reads_as_a_replica(name: str) -> None:
    """``#`` is no character of a Kubernetes name: a claim's own name is always replica 0."""
    assert split(name) == (name, 0) and not is_replica(("ns", name))


def test_odd_tails_are_no_replica_index() -> None:
    for name in ("c#", "c#0", "c#01", "#1", "c#x", "c#-1"):
        assert index_of(("ns", name)) == 0, name


def test_replica_zero_is_called_by_its_model_name_and_the_others_apart() -> None:
    assert route_name("m", ("ns", "c")) == "m"
    assert route_name("m", ("ns", "c#2")) == "m#2"
    assert model_of_route("m#2") == "m" and model_of_route("m") == "m"
    assert model_of_route("org/m-1") == "org/m-1"


def test_replica_keys_name_replicas_one_and_up() -> None:
    assert replica_keys(("ns", "c"), 1) == []
    assert replica_keys(("ns", "c"), 3) == [("ns", "c#1"), ("ns", "c#2")]


def test_replicas_past_the_asked_number_drain_highest_first() -> None:
    known = [("ns", "c#1"), ("ns", "c#3"), ("ns", "c#2"), ("ns", "d#5")]
    assert surplus(("ns", "c"), 2, known) == [("ns", "c#3"), ("ns", "c#2")]
    assert surplus(("ns", "c"), 1, known) == [("ns", "c#3"), ("ns", "c#2"), ("ns", "c#1")]
    assert surplus(("ns", "c"), 8, known) == []


# ---- the claim's summary -----------------------------------------------------------------------


@given(st.lists(st.sampled_from(PHASES), min_size=1, max_size=MAX_REPLICAS))
def test_the_claim_is_active_while_any_replica_serves(phases: list[str]) -> None:
    phase = summary_phase(phases)
    assert phase in phases
    assert (phase == ACTIVE) == (ACTIVE in phases)
    assert ready_count(phases) == phases.count(ACTIVE)


def test_one_replica_summarises_to_its_own_phase() -> None:
    for phase in PHASES:
        assert summary_phase([phase]) == phase


def test_a_claim_without_an_active_replica_shows_its_least_settled_progress() -> None:
    assert summary_phase([SLEEPING, ACTIVATING]) == ACTIVATING
    assert summary_phase([PENDING, SLEEPING]) == SLEEPING
    assert summary_phase(["Failed", PENDING]) == PENDING


def _status(store: StatusStore, name: str, replicas: int) -> ClaimStatus:
    (claim,) = parse_manifests(claim_yaml("c")).claims
    claim = replace(claim, name=name, replicas=replicas)
    return store.ensure(claim)


def _two(store: StatusStore, phase: str) -> ClaimStatus:
    """A claim of two replicas: replica 0 on agent-a in ``phase``, replica 1 Active on
    agent-b."""
    base, other = _status(store, "c", 2), _status(store, "c#1", 2)
    base.set_instance("agent-a", 20001)
    base.set(1.8e9, phase, ready=(False, "Reason", phase))
    other.set_instance("agent-b", 20002)
    other.set(1.8e9, ACTIVE, ready=(True, "ModelClaimActive", "serves on agent-b"))
    return base


def test_the_status_lists_each_replica_as_an_instance_with_its_index_and_phase(
        tmp_path: Path) -> None:
    store = StatusStore(None, lambda: 1.8e9)
    base = _two(store, ACTIVATING)
    doc = base.as_json()["status"]
    assert doc["phase"] == ACTIVE and doc["readyReplicas"] == 1 and doc["desiredReplicas"] == 2
    assert doc["notReadySince"] is None  # a replica serves: the claim is ready
    assert [(i["index"], i["pod"], i["port"], i["phase"]) for i in doc["instances"]] == [
        (0, "agent-a", 20001, ACTIVATING), (1, "agent-b", 20002, ACTIVE)]
    ready = next(c for c in doc["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and "replica 1" in ready["message"]
    assert [s.key for s in store.claims()] == [("default", "c")]
    text = describe(base.as_json())
    assert "Replicas:     1 ready of 2" in text
    assert "Instance:     replica 1 (Active) agent-b port 20002" in text


def test_the_claims_events_include_its_replicas_named_so() -> None:
    store = StatusStore(None, lambda: 1.8e9)
    base = _two(store, ACTIVATING)
    (other,) = base.replicas()
    base.event(1.8e9, "Activated", "serves on agent-a")
    other.event(1.8e9 + 1, "Activated", "serves on agent-b")
    assert [e["message"] for e in base.as_json()["events"]] == [
        "serves on agent-a", "replica 1: serves on agent-b"]
    assert [e["message"] for e in other.as_json()["events"]] == ["serves on agent-b"]
    again = ClaimStatus.from_json(base.as_json())  # read back: its own events only
    assert [e.message for e in again.events] == ["serves on agent-a"]


def test_a_one_replica_claims_status_is_as_it_always_was() -> None:
    store = StatusStore(None, lambda: 1.8e9)
    base = _status(store, "c", 1)
    base.set_instance("agent-a", 20001)
    base.set(1.8e9, ACTIVE, ready=(True, "ModelClaimActive", "serves"))
    doc = base.as_json()["status"]
    assert doc["instances"] == [{"agent": "agent-a", "pod": "agent-a", "port": 20001,
                                 "kvLimitBytes": None, "devices": []}]
    assert doc["readyReplicas"] == 1 and doc["desiredReplicas"] == 1


def test_a_status_read_back_keeps_its_own_phase_and_instance(tmp_path: Path) -> None:
    base = _two(StatusStore(None, lambda: 1.8e9), SLEEPING)
    again = ClaimStatus.from_json(base.as_json())
    assert again.phase == SLEEPING and [i.agent for i in again.instances] == ["agent-a"]
    assert again.desired_replicas == 2
    (other,) = base.replicas()  # a replica's own file: its instance, its phase
    mine = ClaimStatus.from_json(other.as_json())
    assert (mine.name, mine.phase, [i.agent for i in mine.instances]) == (
        "c#1", ACTIVE, ["agent-b"])


def test_a_dropped_replica_leaves_its_claims_status() -> None:
    store = StatusStore(None, lambda: 1.8e9)
    base = _status(store, "c", 2)
    _status(store, "c#1", 2).set_instance("agent-b", 20002)
    assert len(base.as_json()["status"]["instances"]) == 1
    store.drop(("default", "c#1"))
    assert store.replica_keys(("default", "c")) == [] and base.replicas() == []


# ---- the parser, the change rule and the desired state -----------------------------------------


def test_replicas_may_change_after_the_claim_is_created() -> None:
    (one,) = parse_manifests(claim_yaml("c")).claims
    two = replace(one, replicas=2)
    taken = take_change(one, two)
    assert taken.problem is None and taken.claim.replicas == 2
    edited = replace(two, model_name="other")  # with a refused edit, the new count still holds
    kept = take_change(one, edited)
    assert kept.problem is not None and kept.claim.replicas == 2
    assert kept.claim.model_name == one.model_name


def test_the_desired_state_answers_for_a_replica_while_the_claim_asks_for_it() -> None:
    (claim,) = parse_manifests(claim_yaml("c")).claims
    looks = Lookups()
    looks.claims[("default", "c")] = replace(claim, replicas=3)
    got = looks.claim(("default", "c#2"))
    assert got is not None and got.name == "c#2" and got.model_name == claim.model_name
    assert got.route_name == f"{claim.model_name}#2"
    assert looks.claim(("default", "c#2")) is got  # one object while the claim is the same
    assert looks.claim(("default", "c#3")) is None
    looks.claims[("default", "c")] = claim  # scaled down to one
    assert looks.claim(("default", "c#1")) is None and looks.claim(("default", "c#2")) is None
    assert looks.claim(("default", "x#1")) is None


# ---- placement apart ----------------------------------------------------------------------------


def test_a_replica_is_placed_on_an_agent_without_another_replica() -> None:
    cands = [agent("a", card(16)), agent("b", card(10))]
    got = place(need(apart=frozenset({"a"})), cands, NOW)
    assert isinstance(got, Placed) and got.agent == "b"


def test_a_replica_with_only_its_siblings_agent_to_go_to_is_not_placed_there() -> None:
    cands = [agent("a", card(16)), agent("b", card(3))]
    got = place(need(apart=frozenset({"a"})), cands, NOW)
    assert isinstance(got, Unplaced) and got.closest == "b"  # the one that came closest
    alone = place(need(apart=frozenset({"a"})), cands[:1], NOW)
    assert isinstance(alone, Unplaced)
    assert "a: runs another replica of the claim" in alone.message


# ---- the door ----------------------------------------------------------------------------------


def test_a_request_whose_engine_refused_goes_to_another_serving_replica_of_its_claim() -> None:
    keys = (("ns", "c"), ("ns", "c#1"), ("ns", "c#2"), ("ns", "d"))
    serving = {("ns", "c#1"), ("ns", "d")}

    def decide(among: tuple[tuple[str, str], ...]) -> plan.Decision:
        fw = [plan.Forward(k, "h", 1, "a") for k in among if k in serving]
        return plan.choose(fw or [plan.Hold(k, plan.START) for k in among], lambda k: 0)

    got = plan.another(keys, ("ns", "c"), {("ns", "c")}, decide)
    assert got is not None and got.claim == ("ns", "c#1")  # never claim d: another claim
    assert plan.another(keys, ("ns", "c"), {("ns", "c"), ("ns", "c#1")}, decide) is None
    assert plan.another(keys, ("ns", "d"), {("ns", "d")}, decide) is None


def test_a_sleeping_replica_is_woken_only_when_every_awake_one_would_make_a_call_wait_longer(
        ) -> None:
    a, b, c = ("ns", "m"), ("ns", "m#1"), ("ns", "m#2")
    awake = plan.Forward(a, "h", 1, "agent-a")
    asleep = [plan.Hold(b, plan.WAKE, wake=True), plan.Hold(c, plan.WAKE, wake=True)]

    def chosen(wait_s: float, wake_s: float = 2.0) -> plan.Decision:
        return plan.choose([awake, *asleep], lambda k: 0, lambda k: wait_s, lambda k: wake_s)

    assert chosen(1.9) == awake  # queueing is sooner than the wake
    assert chosen(2.0) == awake  # a tie queues: no memory moves for nothing
    assert chosen(2.1) == asleep[0]  # the lowest replica, never all of them by load
    assert chosen(99.0, wake_s=float("inf")) == awake  # no footprint declared: no estimate
    waking = plan.Hold(c, plan.START)  # a wake already asked: calls converge on it
    assert plan.choose([awake, asleep[0], waking], lambda k: 0, lambda k: 9.0,
                       lambda k: 2.0) == waking
    pending = plan.Hold(c, plan.START, kick=True)  # not placed yet: nothing to converge on
    assert plan.choose([awake, pending], lambda k: 0, lambda k: 9.0, lambda k: 2.0) == awake
    # without the figures (a route's first pass), the awake claim wins as before
    assert plan.choose([awake, *asleep], lambda k: 5) == awake


@given(st.lists(st.floats(0, 100), min_size=1, max_size=4), st.floats(0, 100),
       st.sampled_from([plan.WAKE, plan.START, plan.MOVE, plan.ROOM, plan.SETTLE]),
       st.booleans())
def test_an_awake_replica_is_passed_over_only_for_a_sleeping_one_that_wakes_sooner(
        waits: list[float], wake_s: float, cause: str, kick: bool) -> None:
    awake = [plan.Forward(("ns", f"m#{i + 1}"), "h", 1, "agent") for i in range(len(waits))]
    held = plan.Hold(("ns", "m"), cause, kick=kick)
    coming = cause == plan.WAKE or cause == plan.START and not kick
    wait = {d.claim: w for d, w in zip(awake, waits)}
    got = plan.choose([held, *awake], lambda k: 0, wait.__getitem__, lambda k: wake_s)
    if coming and min(waits) > wake_s:
        assert got == held
    else:
        assert isinstance(got, plan.Forward)
