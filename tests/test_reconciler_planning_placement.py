"""Placement: which agent takes a claim, the guide's preferences and reasons, retry delays."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.quantity import GiB, MiB
from contract.reasons import NO_MATCHING_PODS, TOO_LARGE
from reconciler.model.manifests import parse_manifests
from reconciler.model.policy import PoolPolicy
from reconciler.model.selector import LabelSelector
from reconciler.planning.placement import (
    ClaimNeed,
    Placed,
    Unplaced,
    place,
    retry_delay,
)
from reconciler.planning.state import Candidate, EngineState, Gpu, Resident, charge
from tests.test_reconciler_manifests import SEED_CLAIMS

POOL_LABELS = {"claim.model.aibrix.ai/pool": "pool-a", "claim.model.aibrix.ai/enabled": "true"}
SELECTOR = LabelSelector({"claim.model.aibrix.ai/pool": "pool-a"})
NO_RESERVE = PoolPolicy(300, True, 30)
NOW = 1000.0


def need(footprint: float = 6, kv_floor: float = 1, gpus: int = 1, all_gpus: bool = True,
         artifact: str = "huggingface://Qwen/Qwen3-0.6B", **kw: object) -> ClaimNeed:
    return ClaimNeed("default/c", SELECTOR, int(footprint * GiB), int(kv_floor * GiB), gpus,
                     all_gpus, artifact_url=artifact, **kw)  # type: ignore[arg-type]


def engine(name: str, footprint: float = 6, kv_floor: float = 1, **kw: object) -> Resident:
    return Resident(name, int(footprint * GiB), int(kv_floor * GiB), **kw)  # type: ignore[arg-type]


def card(usable: float, *engines: Resident, index: int = 0) -> Gpu:
    return Gpu(index, int(usable * GiB), engines)


def agent(name: str, *gpus: Gpu, **kw: object) -> Candidate:
    labels = kw.pop("labels", POOL_LABELS)
    return Candidate(name, gpus or (card(16),), labels, **kw)  # type: ignore[arg-type]


# ---- the guide's example --------------------------------------------------------------------


def test_the_guides_two_claims_share_one_16_gib_card_and_a_third_does_not_fit() -> None:
    claims = parse_manifests(SEED_CLAIMS).claims
    pod = agent("pool-pod-0")
    for claim in claims:
        got = place(ClaimNeed.from_claim(claim), [pod], NOW)
        assert isinstance(got, Placed) and got.agent == "pool-pod-0" and got.devices == (0,)
        pod = pod.with_resident(engine(claim.key, state=EngineState.STARTING), got.devices)
    third = place(need(), [pod], NOW)
    assert third == Unplaced(NO_MATCHING_PODS, "pool-pod-0: needs 7.0 GiB on GPU, 2.0 GiB free",
                             "pool-pod-0")


def test_the_message_names_the_candidate_that_came_closest_and_what_it_lacks() -> None:
    a = agent("agent-a", card(16, engine("x", 12, 1)))  # 3.0 free
    b = agent("agent-b", card(16, engine("y", 11.5, 1)))  # 3.5 free
    c = agent("agent-c", card(16), healthy=False)
    got = place(need(), [a, b, c], NOW)
    assert got == Unplaced(NO_MATCHING_PODS, "agent-b: needs 7.0 GiB on GPU, 3.5 GiB free",
                           "agent-b")


def test_a_claim_without_usable_per_gpu_is_invalid_per_gpu() -> None:
    for bad in (ClaimNeed("c", SELECTOR, None, None), ClaimNeed("c", SELECTOR, 0, GiB),
                ClaimNeed("c", SELECTOR, GiB, -1)):
        got = place(bad, [agent("a")], NOW)
        assert isinstance(got, Unplaced) and got.reason == "InvalidPerGPU"


def test_a_claim_larger_than_every_card_in_its_pool_is_too_large_for_any_card() -> None:
    pods = [agent("a", card(16)), agent("b", card(24), healthy=False)]
    got = place(need(20, 5), pods, NOW)
    assert isinstance(got, Unplaced) and got.reason == TOO_LARGE
    assert "24.0 GiB" in got.message
    # A card large enough but full is NoMatchingPods: waiting can help.
    got = place(need(20, 3), pods, NOW)
    assert isinstance(got, Unplaced) and got.reason == NO_MATCHING_PODS


def test_cards_outside_the_claims_pool_do_not_make_it_fit() -> None:
    other = agent("big", card(80), labels={"claim.model.aibrix.ai/pool": "pool-b",
                                           "claim.model.aibrix.ai/enabled": "true"})
    got = place(need(20, 5), [agent("a"), other], NOW)
    assert isinstance(got, Unplaced) and got.reason == TOO_LARGE


# ---- who may take a claim -------------------------------------------------------------------


@pytest.mark.parametrize("pod, fragment", [
    (agent("x", labels={"claim.model.aibrix.ai/pool": "pool-a"}), "not enabled"),
    (agent("x", labels={**POOL_LABELS, "claim.model.aibrix.ai/enabled": "True"}), "not enabled"),
    (agent("x", healthy=False), "not ready"),
    (agent("x", observed_at=NOW - 31), "31 s old"),
    (agent("x", foreign_engines=("stray",)), "stray answers to no claim"),
    (agent("x", card(16), card(16, index=1)), "has 2 GPUs, the claim needs 1"),
])
def test_only_enabled_healthy_agents_with_the_right_gpus_take_claims(pod: Candidate,
                                                                     fragment: str) -> None:
    got = place(need(), [pod], NOW)
    assert isinstance(got, Unplaced) and got.reason == NO_MATCHING_PODS
    assert got.message.startswith("no available candidate warm pod: x: ")
    assert fragment in got.message and got.closest == "x"


def test_only_agents_in_the_claims_namespace_that_match_its_selector_are_candidates() -> None:
    elsewhere = agent("x", namespace="other")
    unlabelled = agent("y", labels={"claim.model.aibrix.ai/enabled": "true"})
    got = place(need(), [elsewhere, unlabelled], NOW)
    assert isinstance(got, Unplaced) and got.reason == NO_MATCHING_PODS
    assert "no agent in namespace default matches the podSelector" in got.message
    assert "claim.model.aibrix.ai/pool=pool-a" in got.message


def test_a_claim_moving_away_skips_the_agent_it_leaves() -> None:
    got = place(need(exclude=frozenset({"a"})), [agent("a"), agent("b")], NOW)
    assert isinstance(got, Placed) and got.agent == "b"


def test_a_fresh_snapshot_counts_and_an_unknown_age_is_trusted() -> None:
    assert isinstance(place(need(), [agent("x", observed_at=NOW - 30)], NOW), Placed)
    assert isinstance(place(need(), [agent("x", observed_at=None)], NOW), Placed)


def test_a_tensor_parallel_claim_uses_every_gpu_of_a_pod_with_exactly_that_many() -> None:
    two = agent("two", card(16), card(16, index=1))
    one = agent("one", card(80))
    got = place(need(gpus=2), [one, two], NOW)
    assert got == Placed("two", (0, 1), 9 * GiB)
    full = agent("two", card(16), card(16, engine("e", 8, 2), index=1))
    got = place(need(gpus=2), [one, full], NOW)
    assert isinstance(got, Unplaced)
    assert "two: needs 7.0 GiB on each of 2 GPUs, 6.0 GiB free on GPU 1" == got.message


def test_an_ollama_claim_takes_the_gpu_with_the_most_room() -> None:
    pod = agent("x", card(16, engine("e", 8, 1)), card(16, engine("f", 4, 1), index=1))
    got = place(need(all_gpus=False), [pod], NOW)
    assert got == Placed("x", (1,), 4 * GiB)


# ---- what engines already there count for ---------------------------------------------------


def test_an_engine_counts_with_its_footprint_and_at_least_its_kv_floor() -> None:
    quiet = engine("e", 6, 1, kv_used=0)
    busy = engine("e", 6, 1, kv_used=4 * GiB)
    policy = PoolPolicy()
    assert charge(quiet, policy) == 7 * GiB and charge(busy, policy) == 10 * GiB
    assert isinstance(place(need(), [agent("a", card(16, quiet))], NOW), Placed)
    assert isinstance(place(need(), [agent("a", card(16, busy))], NOW), Unplaced)


def test_a_sleeping_engine_keeps_its_room_unless_the_pool_says_otherwise() -> None:
    asleep = engine("s", 8, 2, state=EngineState.ASLEEP, sleeping_footprint=GiB)
    unknown = engine("s", 8, 2, state=EngineState.ASLEEP)
    assert isinstance(place(need(), [agent("a", card(16, asleep))], NOW), Unplaced)
    got = place(need(), [agent("a", card(16, asleep), policy=NO_RESERVE)], NOW)
    assert got == Placed("a", (0,), 8 * GiB)
    got = place(need(), [agent("a", card(16, unknown), policy=NO_RESERVE)], NOW)
    assert isinstance(got, Unplaced)


# ---- preferences ----------------------------------------------------------------------------


def test_an_agent_that_served_the_artifact_is_preferred_then_fewest_awake_then_most_room() -> None:
    roomy = agent("roomy", card(80, engine("r", 1, 1)))
    crowded = agent("crowded", card(40, engine("e1", 1, 1), engine("e2", 1, 1)))
    quiet = agent("quiet", card(20, engine("s", 1, 1, state=EngineState.ASLEEP)))
    served = agent("served", card(40, engine("e3", 1, 1), engine("e4", 1, 1), engine("e5", 1, 1)),
                   cached_artifacts=frozenset({"hf://Qwen/Qwen3-0.6B"}))
    assert place(need(), [roomy, crowded, quiet, served], NOW).agent == "served"  # type: ignore
    assert place(need(), [roomy, crowded, quiet], NOW).agent == "quiet"  # type: ignore
    assert place(need(), [crowded, agent("roomy", card(80, engine("e9", 1, 1), engine(
        "e8", 1, 1)))], NOW).agent == "roomy"  # type: ignore
    assert place(need(), [agent("b"), agent("a")], NOW).agent == "a"  # type: ignore


# ---- retries --------------------------------------------------------------------------------


def test_placement_is_retried_after_10_20_and_40_seconds_then_every_minute() -> None:
    assert [retry_delay(n) for n in range(7)] == [10, 20, 40, 60, 60, 60, 60]
    with pytest.raises(ValueError):
        retry_delay(-1)


# ---- properties -----------------------------------------------------------------------------

_engines = st.builds(
    Resident,
    name=st.sampled_from(["e1", "e2", "e3", "e4"]),
    footprint=st.integers(1, 12).map(lambda g: g * GiB),
    kv_floor=st.integers(1, 4096).map(lambda m: m * MiB),
    state=st.sampled_from(list(EngineState)),
    kv_used=st.none() | st.integers(0, 6 * GiB),
    sleeping_footprint=st.none() | st.integers(0, 2 * GiB),
)


@st.composite
def _candidates(draw: st.DrawFn) -> Candidate:
    n_gpus = draw(st.integers(1, 2))
    engines = draw(st.lists(_engines, max_size=3, unique_by=lambda e: e.name))
    gpus = tuple(Gpu(i, draw(st.integers(8, 80)) * GiB, tuple(engines)) for i in range(n_gpus))
    enabled = draw(st.booleans())
    labels = {**POOL_LABELS, "claim.model.aibrix.ai/enabled": "true" if enabled else "false"}
    return Candidate(draw(st.sampled_from("abcdefgh")), gpus, labels,
                     healthy=draw(st.booleans()),
                     policy=draw(st.sampled_from([PoolPolicy(), NO_RESERVE])),
                     cached_artifacts=draw(st.sampled_from([frozenset(), frozenset({"art"})])),
                     observed_at=draw(st.none() | st.floats(NOW - 60, NOW)))


_needs = st.builds(ClaimNeed, name=st.just("c"), selector=st.just(SELECTOR),
                   footprint=st.integers(1, 40).map(lambda g: g * GiB),
                   kv_floor=st.integers(1, 8).map(lambda g: g * GiB),
                   gpus=st.integers(1, 2), all_gpus=st.booleans(), artifact_url=st.just("art"))


def _eligible(n: ClaimNeed, c: Candidate) -> bool:
    count_ok = len(c.gpus) == n.gpus if n.all_gpus else len(c.gpus) >= n.gpus
    fresh = c.observed_at is None or NOW - c.observed_at <= 30
    return c.enabled and c.healthy and fresh and count_ok


@settings(max_examples=300)
@given(_needs, st.lists(_candidates(), max_size=4, unique_by=lambda c: c.name))
def test_a_placement_always_has_room_and_one_is_found_whenever_any_agent_has_room(
        n: ClaimNeed, pods: list[Candidate]) -> None:
    room = n.room
    assert room is not None
    got = place(n, pods, NOW)
    fitting = [c for c in pods if _eligible(n, c) and sum(
        g.room(c.policy) >= room for g in c.gpus) >= (len(c.gpus) if n.all_gpus else n.gpus)]
    if isinstance(got, Placed):
        pod = next(c for c in pods if c.name == got.agent)
        assert _eligible(n, pod)
        assert len(got.devices) == n.gpus and list(got.devices) == sorted(set(got.devices))
        assert all(g.room(pod.policy) >= room for g in pod.gpus if g.index in got.devices)
        after = pod.with_resident(Resident("new", n.footprint or 0, n.kv_floor or 0),
                                  got.devices)
        assert all(g.room(pod.policy) >= 0 for g in after.gpus if g.index in got.devices)
        # No fitting agent is better by the guide's order.
        best = min((("art" not in c.cached_artifacts), c.models_awake) for c in fitting)
        assert (("art" not in pod.cached_artifacts), pod.models_awake) == best
    else:
        assert fitting == []
        assert got.reason in (NO_MATCHING_PODS, TOO_LARGE)
        if got.reason == TOO_LARGE:
            assert all(room > g.usable for c in pods for g in c.gpus)


@settings(max_examples=100)
@given(_needs, st.lists(_candidates(), max_size=4, unique_by=lambda c: c.name))
def test_the_answer_does_not_depend_on_the_order_of_the_candidates(
        n: ClaimNeed, pods: list[Candidate]) -> None:
    answers = {place(n, list(order), NOW) for order in itertools.permutations(pods)}
    assert len(answers) == 1
