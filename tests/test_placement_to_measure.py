"""A claim with no figures (no perGPU, and an artifact that cannot be read to estimate them) is
placed to be measured: on GPUs no other engine uses or has reserved, and it holds them whole
until measured; it gets no KV limit and is never slept. Pure planners."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from contract.quantity import GiB, MiB
from contract.reasons import NO_MATCHING_PODS
from reconciler.model.policy import PoolPolicy
from reconciler.planning.kv_division import committed, divide
from reconciler.planning.placement import MEASURE_MIN_ROOM, ClaimNeed, Placed, Unplaced, place
from reconciler.planning.sleep_policy import idle_to_sleep, may_sleep_for_room, victims
from reconciler.planning.state import Candidate, EngineState, Gpu, Resident
from tests.test_reconciler_planning_placement import NOW, POOL_LABELS, SELECTOR, agent, card, engine

WHY = "huggingface://t/m is not a local directory this reconciler can read"
IDLE = PoolPolicy(300, True, 30)


def unmeasured(gpus: int = 1, all_gpus: bool = True, artifact: str = "huggingface://t/m",
               **kw: object) -> ClaimNeed:
    return ClaimNeed("default/u", SELECTOR, None, None, gpus, all_gpus, artifact_url=artifact,
                     unmeasured=WHY, **kw)  # type: ignore[arg-type]


def being_measured(name: str = "u", held: float = 2, **kw: object) -> Resident:
    return Resident(name, int(held * GiB), 0, unmeasured=True, **kw)  # type: ignore[arg-type]


def test_it_goes_to_an_empty_card_never_beside_any_engine_even_a_sleeping_one() -> None:
    busy = agent("agent-a", card(80, engine("x", 6, 1)))  # 73 GiB free, but x is there
    asleep = agent("agent-b", card(80, engine("y", state=EngineState.ASLEEP)))
    empty = agent("agent-c", card(16))
    assert place(unmeasured(), [busy, asleep, empty], NOW) == Placed("agent-c", (0,), 16 * GiB)
    got = place(unmeasured(), [busy, asleep], NOW)
    assert got == Unplaced(NO_MATCHING_PODS, (
        f"the claim has no perGPU and no estimate ({WHY}), so it is measured on GPUs no other "
        "engine uses: agent-a: GPU 0 runs x"), "agent-a")


def test_a_reservation_counts_as_an_engine_there() -> None:
    pod = agent("agent-a").with_resident(
        Resident("starting", 6 * GiB, GiB, EngineState.STARTING), (0,))
    got = place(unmeasured(), [pod], NOW)
    assert isinstance(got, Unplaced) and got.message.endswith("agent-a: GPU 0 runs starting")


def test_a_card_with_under_a_gib_free_of_other_processes_is_not_tried() -> None:
    pod = agent("agent-a", Gpu(0, 16 * GiB, (), other=16 * GiB - 512 * MiB))
    got = place(unmeasured(), [pod], NOW)
    assert isinstance(got, Unplaced) and got.message.endswith(
        "agent-a: 512.0 MiB free on GPU 0, under the 1.0 GiB a measured start needs")


def test_served_first_then_most_room_then_name() -> None:
    small = agent("agent-a", card(16))
    large = agent("agent-b", card(80))
    large2 = agent("agent-c", card(80))
    served = agent("agent-d", card(16), cached_artifacts=frozenset({"huggingface://t/m"}))
    for pods, chosen in (([small, large, large2, served], "agent-d"),
                         ([small, large2, large], "agent-b")):
        got = place(unmeasured(), pods, NOW)
        assert isinstance(got, Placed) and got.agent == chosen


def test_an_ollama_claim_takes_the_emptiest_gpus_of_a_pod() -> None:
    pod = agent("agent-a", card(80, engine("x"), index=0), card(16, index=1),
                card(24, index=2))
    assert place(unmeasured(all_gpus=False), [pod], NOW) == Placed("agent-a", (2,), 24 * GiB)
    assert place(unmeasured(gpus=2, all_gpus=False), [pod], NOW) == Placed(
        "agent-a", (1, 2), 16 * GiB)


def test_unavailable_agents_say_why_as_for_any_claim() -> None:
    got = place(unmeasured(), [agent("agent-a", healthy=False)], NOW)
    assert got == Unplaced(NO_MATCHING_PODS, "no available candidate warm pod: agent-a: not ready",
                           "agent-a")


def test_while_it_is_measured_it_holds_its_card_whole() -> None:
    pod = agent("agent-a", card(80, being_measured(held=2)))
    assert pod.gpus[0].room(pod.policy) == 0
    assert isinstance(place(ClaimNeed("default/c", SELECTOR, GiB, GiB, artifact_url="a"),
                            [pod], NOW), Unplaced)
    assert isinstance(place(unmeasured(), [pod], NOW), Unplaced)


def test_it_gets_no_kv_limit_and_others_beside_it_count_what_it_holds() -> None:
    u = being_measured(held=10)
    x = engine("x", 6, 1)
    limits = divide(32 * GiB, [u, x])
    assert "u" not in limits and limits["x"] >= GiB
    assert committed([u, x], limits) <= 32 * GiB


def test_it_is_never_slept_for_idleness_or_for_room() -> None:
    u = being_measured(last_busy=0.0)
    assert idle_to_sleep([u], IDLE, NOW) == []
    assert not may_sleep_for_room(u, IDLE, NOW)
    assert victims(16 * GiB, 8 * GiB, [u], IDLE, NOW) is None


_residents = st.builds(
    Resident, name=st.sampled_from(["e1", "e2", "e3"]),
    footprint=st.integers(0, 12).map(lambda g: g * GiB),
    kv_floor=st.integers(0, 2048).map(lambda m: m * MiB),
    state=st.sampled_from(list(EngineState)), unmeasured=st.booleans())


@st.composite
def _pods(draw: st.DrawFn) -> Candidate:
    n = draw(st.integers(1, 3))
    gpus = tuple(Gpu(i, draw(st.integers(1, 80)) * GiB,
                     tuple(draw(st.lists(_residents, max_size=2, unique_by=lambda e: e.name))),
                     other=draw(st.integers(0, 2048)) * MiB) for i in range(n))
    return Candidate(draw(st.sampled_from("abcdef")), gpus, POOL_LABELS,
                     healthy=draw(st.booleans()),
                     cached_artifacts=draw(st.sampled_from([frozenset(),
                                                            frozenset({"huggingface://t/m"})])))


def _takes(n: ClaimNeed, pod: Candidate, devices: tuple[int, ...]) -> bool:
    gpus = [g for g in pod.gpus if g.index in devices]
    return all(not g.engines and g.usable - g.other >= MEASURE_MIN_ROOM for g in gpus)


@settings(max_examples=300)
@given(st.integers(1, 2), st.booleans(),
       st.lists(_pods(), max_size=4, unique_by=lambda c: c.name))
def test_it_is_placed_only_alone_and_whenever_some_pod_can_hold_it_alone(
        gpus: int, all_gpus: bool, pods: list[Candidate]) -> None:
    n = unmeasured(gpus, all_gpus)
    got = place(n, pods, NOW)
    def fits(c: Candidate) -> bool:
        count = len(c.gpus) == gpus if all_gpus else len(c.gpus) >= gpus
        empty = [g for g in c.gpus if not g.engines and g.usable - g.other >= MEASURE_MIN_ROOM]
        return c.healthy and count and (len(empty) == len(c.gpus) if all_gpus
                                        else len(empty) >= gpus)
    if isinstance(got, Placed):
        pod = next(c for c in pods if c.name == got.agent)
        assert fits(pod) and _takes(n, pod, got.devices) and len(got.devices) == gpus
        # once it is there, nothing else fits on those GPUs until it is measured
        after = pod.with_resident(being_measured("new", 0), got.devices)
        assert all(g.room(pod.policy) <= 0 for g in after.gpus if g.index in got.devices)
    else:
        assert not [c for c in pods if fits(c)]
        assert got.reason == NO_MATCHING_PODS


@settings(max_examples=100)
@given(st.lists(_pods(), max_size=4, unique_by=lambda c: c.name))
def test_the_answer_does_not_depend_on_the_order_of_the_pods(pods: list[Candidate]) -> None:
    answers = {place(unmeasured(), list(order), NOW) for order in itertools.permutations(pods)}
    assert len(answers) == 1


@settings(max_examples=300)
@given(st.lists(_residents, max_size=4, unique_by=lambda e: e.name), st.integers(1, 80))
def test_a_gpu_with_an_unmeasured_engine_never_shows_room(engines: list[Resident],
                                                          usable: int) -> None:
    gpu = Gpu(0, usable * GiB, tuple(engines))
    for policy in (PoolPolicy(), IDLE):
        room = gpu.room(policy)
        if any(e.unmeasured for e in engines):
            assert room <= 0
        for e in engines:
            left = gpu.room(policy, leave_out=e.name)
            if any(o.unmeasured for o in engines if o.name != e.name):
                assert left <= 0
