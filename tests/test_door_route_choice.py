"""The door's per-call choice for a ModelRoute (``reconciler.door.routing.Router``) over what
``plan.decide`` says of each candidate claim: the mapping table of the module's docstring."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from contract.quantity import GiB

from reconciler.desired import ClaimKey
from reconciler.local.desired import DesiredState
from reconciler.door import plan
from reconciler.door.forwards import Forwards, slots
from reconciler.door.routing import Rechoice, Routed, Router
from reconciler.selection.refusals import ZeroMatch
from reconciler.selection.view import CopyState
from tests.reconciler_fakes import claim_yaml
from tests.test_door_modelroute import route

pytestmark = pytest.mark.timeout(30)
BIG, SMALL = ("default", "big"), ("default", "small")


def labelled(name: str, tier: str, context: int, **args: str) -> str:
    text = claim_yaml(name, args={"--max-model-len": str(context), **args})
    return text.replace("  namespace: default\n",
                        f'  namespace: default\n  labels: {{family: qwen, tier: "{tier}"}}\n', 1)


def router(tmp_path: Path, decisions: dict[ClaimKey, plan.Decision], tolerance: float = 10,
           wakes: frozenset[str] = frozenset(), family: str = "qwen",
           big_context: int = 2048, forwards: Forwards | None = None,
           small_args: Mapping[str, str] | None = None) -> tuple[Router, DesiredState]:
    (tmp_path / "all.yaml").write_text(labelled("big", "big", big_context)
                                       + labelled("small", "small", 4096, **(small_args or {}))
                                       + "---\n" + route("chat", tolerance, family))
    desired = DesiredState(tmp_path)
    desired.load()
    contexts = {BIG: big_context, SMALL: 4096}
    return Router(desired, contexts.get, lambda: 0, decisions.__getitem__,
                  wakes.__contains__, lambda: 100.0, forwards), desired


def pick(r: Router, desired: DesiredState, doc: Mapping[str, Any] | None = None
         ) -> Routed | object:
    body = doc or {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    return r.choose(desired.routes["chat"], "chat", body, str(body).encode())


FWD_BIG = plan.Forward(BIG, "127.0.0.1", 1, "agent-a")
FWD_SMALL = plan.Forward(SMALL, "127.0.0.1", 2, "agent-a")
ASLEEP_BIG = plan.Hold(BIG, plan.WAKE, wake=True)
ASLEEP_SMALL = plan.Hold(SMALL, plan.WAKE, wake=True)


def test_the_preferred_claim_serving_is_chosen_warm(tmp_path: Path) -> None:
    r, d = router(tmp_path, {BIG: FWD_BIG, SMALL: FWD_SMALL})
    assert pick(r, d) == Routed("chat", "warm", BIG, "big")


def test_a_warm_candidate_in_tolerance_wins_over_waking_the_preferred(tmp_path: Path) -> None:
    r, d = router(tmp_path, {BIG: ASLEEP_BIG, SMALL: FWD_SMALL})
    assert pick(r, d) == Routed("chat", "warm", SMALL, "small")


def test_with_tolerance_zero_the_sleeping_preferred_is_woken(tmp_path: Path) -> None:
    r, d = router(tmp_path, {BIG: ASLEEP_BIG, SMALL: FWD_SMALL}, tolerance=0)
    assert pick(r, d) == Routed("chat", "woken", BIG, "big")


def test_a_wake_already_asked_is_converged_on(tmp_path: Path) -> None:
    r, d = router(tmp_path, {BIG: ASLEEP_BIG, SMALL: ASLEEP_SMALL}, wakes=frozenset({"big"}))
    assert pick(r, d) == Routed("chat", "converged", BIG, "big")
    r, d = router(tmp_path, {BIG: plan.Hold(BIG, plan.START), SMALL: ASLEEP_SMALL})
    assert pick(r, d) == Routed("chat", "converged", BIG, "big")


def test_a_pending_preferred_claim_is_started(tmp_path: Path) -> None:
    r, d = router(tmp_path, {BIG: plan.Hold(BIG, plan.ROOM, kick=True), SMALL: ASLEEP_SMALL},
                  tolerance=0)
    assert pick(r, d) == Routed("chat", "started", BIG, "big")


def test_a_preferred_claim_that_cannot_serve_holds_the_call_for_its_own_answer(
        tmp_path: Path) -> None:
    r, d = router(tmp_path, {BIG: plan.Refuse(BIG, "too large", None), SMALL: ASLEEP_SMALL},
                  tolerance=0)
    assert pick(r, d) == Routed("chat", "held", BIG, "big")


def test_a_route_that_matches_nothing_is_refused_naming_its_selector(tmp_path: Path) -> None:
    r, d = router(tmp_path, {}, family="llama")
    got = pick(r, d)
    assert isinstance(got, ZeroMatch) and "family=llama" in got.message


def test_a_long_prompt_passes_over_a_candidate_whose_context_cannot_hold_it(
        tmp_path: Path) -> None:
    r, d = router(tmp_path, {BIG: ASLEEP_BIG, SMALL: ASLEEP_SMALL}, tolerance=0, big_context=64)
    doc = {"model": "chat", "messages": [{"role": "user", "content": "word " * 300}]}
    assert pick(r, d, doc) == Routed("chat", "woken", SMALL, "small")
    short = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    assert pick(r, d, short) == Routed("chat", "woken", BIG, "big")


def waking_big(tmp_path: Path
               ) -> tuple[dict[ClaimKey, plan.Decision], Router, DesiredState, Routed]:
    """Both candidates asleep: the first choice wakes big (the decisions may be changed)."""
    decisions: dict[ClaimKey, plan.Decision] = {BIG: ASLEEP_BIG, SMALL: ASLEEP_SMALL}
    r, d = router(tmp_path, decisions)
    first = pick(r, d)
    assert first == Routed("chat", "woken", BIG, "big") and isinstance(first, Routed)
    return decisions, r, d, first


def rechoice(r: Router, d: DesiredState, first: Routed,
             usable: frozenset[ClaimKey] = frozenset({BIG, SMALL})) -> Rechoice:
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    return Rechoice(r, d.routes["chat"], "chat", body, str(body).encode(), first,
                    usable.__contains__)


def test_a_held_call_goes_to_a_candidate_that_became_warm_and_names_its_first_choice(
        tmp_path: Path) -> None:
    decisions, r, d, first = waking_big(tmp_path)
    again = rechoice(r, d, first)
    decisions[BIG] = plan.Hold(BIG, plan.START)  # the wake under way: keep waiting for it
    assert again.again(lost=False) is None and again.routed == first
    decisions[SMALL] = FWD_SMALL  # woken by someone else meanwhile
    got = again.again(lost=False)
    assert got == Routed("chat", "warm", SMALL, "small", rechosen_from=BIG)
    assert again.routed == got
    assert got.headers("agent-a")["x-route-rechosen-from"] == "default/big"


def test_a_held_call_is_not_moved_to_a_candidate_that_is_only_coming_up_or_cannot_serve_it(
        tmp_path: Path) -> None:
    decisions, r, d, first = waking_big(tmp_path)
    decisions[BIG], decisions[SMALL] = ASLEEP_BIG, plan.Hold(SMALL, plan.START)
    assert rechoice(r, d, first).again(lost=False) is None  # converging on small: no better
    decisions[SMALL] = FWD_SMALL
    assert rechoice(r, d, first, frozenset({BIG})).again(lost=False) is None  # wrong engine


def test_a_held_call_whose_claim_cannot_serve_takes_whatever_the_choice_says_now(
        tmp_path: Path) -> None:
    decisions, r, d, first = waking_big(tmp_path)
    decisions[BIG] = plan.Refuse(BIG, "failed", 10)
    again = rechoice(r, d, first)
    assert again.again(lost=False) is None  # held for big's own answer: not lost yet
    assert again.again(lost=True) is None  # the choice holds for big again: its refusal stands
    decisions[BIG] = plan.Hold(BIG, plan.ROOM, kick=True)
    decisions[SMALL] = plan.Hold(SMALL, plan.START)
    assert again.again(lost=True) == Routed("chat", "converged", SMALL, "small",
                                            rechosen_from=BIG)


# The queue option, fed with the door's own forwards.
def test_an_engines_slots_come_from_its_args_else_its_own_default() -> None:
    assert slots("vllm", {"--max-num-seqs": "8"}) == 8
    assert slots("vllm", {}) == 256 and slots("vllm", {"--max-num-seqs": "x"}) == 256
    assert slots("vllm", {"--max-num-seqs": "9" * 5000}) == 256  # int() would raise on it
    assert slots("vllm", {"--max-num-seqs": "-5"}) == 256
    assert slots("vllm", {"--max-num-seqs": "0"}) == 256
    assert slots("ollama", {"--num-parallel": "3"}) == 3 and slots("ollama", {}) == 1


def test_the_door_counts_its_forwards_per_claim_and_averages_their_latency() -> None:
    fw = Forwards()
    fw.start(SMALL, 10.0)
    fw.start(SMALL, 11.0)
    assert fw.in_flight(SMALL) == (10.0, 11.0) and fw.latency(SMALL) is None
    fw.end(SMALL, 10.0, 14.0, answered=True)
    assert fw.in_flight(SMALL) == (11.0,) and fw.latency(SMALL) == 4.0
    fw.end(SMALL, 11.0, 12.0, answered=True)  # 4 + 0.3 * (1 - 4)
    assert fw.in_flight(SMALL) == () and fw.latency(SMALL) == pytest.approx(3.1)
    fw.start(SMALL, 20.0)
    fw.end(SMALL, 20.0, 20.1, answered=False)  # a broken answer says nothing of the engine
    assert fw.latency(SMALL) == pytest.approx(3.1) and fw.in_flight(BIG) == ()


def test_a_warm_copy_in_the_view_has_the_door_s_in_flight_slots_and_latency(
        tmp_path: Path) -> None:
    fw = Forwards()
    fw.start(SMALL, 90.0)
    fw.end(SMALL, 90.0, 92.0, answered=True)
    fw.start(SMALL, 99.0)
    r, d = router(tmp_path, {BIG: ASLEEP_BIG, SMALL: FWD_SMALL}, forwards=fw,
                  small_args={"--max-num-seqs": "1"})
    view = r.view(r.candidates(d.routes["chat"])[0], ("default/big", "default/small"))
    (small,), (big,) = view.copies["default/small"], view.copies["default/big"]
    assert (small.slots, small.in_flight, small.latency_s, small.free_slot) == (
        1, (99.0,), 2.0, False)
    assert (big.state, big.size) == (CopyState.ASLEEP, 6 * GiB) and view.room_unknown


@pytest.mark.parametrize(("latency_end", "expected"), [
    (92.0, Routed("chat", "queued", SMALL, "small")),  # 2 s calls: 1 s left beats a 6 s wake
    (None, Routed("chat", "woken", BIG, "big")),  # none seen: 30 s, less 1 s gone
    (98.0, Routed("chat", "woken", BIG, "big")),  # 8 s calls: 7 s left loses to it
])
def test_a_full_warm_candidate_queues_the_call_or_the_preferred_is_woken_by_the_figures(
        tmp_path: Path, latency_end: float | None, expected: Routed) -> None:
    fw = Forwards()
    if latency_end is not None:
        fw.start(SMALL, 90.0)
        fw.end(SMALL, 90.0, latency_end, answered=True)
    fw.start(SMALL, 99.0)  # the clock reads 100
    r, d = router(tmp_path, {BIG: ASLEEP_BIG, SMALL: FWD_SMALL}, forwards=fw,
                  small_args={"--max-num-seqs": "1"})
    assert pick(r, d) == expected


def test_a_warm_candidate_with_its_default_slots_is_not_full_with_one_call(
        tmp_path: Path) -> None:
    fw = Forwards()
    fw.start(SMALL, 99.0)
    r, d = router(tmp_path, {BIG: ASLEEP_BIG, SMALL: FWD_SMALL}, forwards=fw)
    assert pick(r, d) == Routed("chat", "warm", SMALL, "small")
