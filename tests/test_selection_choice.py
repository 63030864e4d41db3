"""The per-call choice for a route, step by step in the seed's order, with the seed's worked
example as numbers: queue at a busy 14B copy rather than unload a wanted 32B, and unload an idle
unwanted 8B rather than wait behind five calls."""

from __future__ import annotations

import pytest

from contract.quantity import GiB
from reconciler.model.selector import LabelSelector
from reconciler.selection.candidates import ClaimInfo, rank
from reconciler.selection.choice import Choice, Kind, choose, plan_for
from reconciler.selection.delay import Demand, queue_wait, victim_cost
from reconciler.selection.refusals import (
    Busy,
    ModelTooLarge,
    PromptNeed,
    PromptTooLarge,
    ZeroMatch,
    context_needed,
)
from reconciler.selection.reservations import Book, Plan
from reconciler.selection.route_spec import Prefer, Route
from reconciler.selection.victims import Occupant
from reconciler.selection.view import Copy, CopyState, GpuView, View

pytestmark = pytest.mark.timeout(30)
NOW = 10_000.0
LONG_IDLE = NOW - 600.0

# The seed's worked example: qwen3:14b (12 GiB with its KV: it loads in 12 s at 1 GiB/s) is
# wanted; one copy of it is warm and busy on the 4090; another may start on the 5090, where a
# qwen3:32b (27 GiB) is warm, idle and used at a rate of 1.
FOURTEEN = 12 * GiB
ROUTE = Route("chat", require=LabelSelector({"params": "14B"}))
CLAIMS = [ClaimInfo("qwen3-14b", {"params": "14B"}, FOURTEEN),
          ClaimInfo("qwen3-14b-spare", {"params": "14B"}, FOURTEEN)]
QWEN32 = Occupant("qwen3-32b", 27 * GiB, idle_since=LONG_IDLE, demand=Demand(recent_use=1.0))
QWEN8 = Occupant("qwen3-8b", 6 * GiB, idle_since=LONG_IDLE)  # unwanted: no demand at all


def spare(calls: int) -> Copy:
    """The 4090's copy: one slot, one call 5 s into a typical 20 s call, the rest waiting."""
    return Copy("qwen3-14b-spare", "agent-b", "4090", CopyState.ACTIVE, slots=1,
                in_flight=(NOW - 5.0,), queued=calls - 1, latency_s=20.0)


def stopped_on(gpu: str) -> Copy:
    return Copy(f"qwen3-14b@{gpu}", "agent-a" if gpu == "5090" else "agent-c", gpu,
                CopyState.STOPPED, needs=FOURTEEN, size=FOURTEEN)


def seed_view(calls: int, *, with_8b: bool, book: Book = Book()) -> View:
    gpus = {"5090": GpuView("5090", 32 * GiB, 5 * GiB, (QWEN32,)),
            "4090": GpuView("4090", 24 * GiB, 12 * GiB)}
    copies = [stopped_on("5090")]
    if with_8b:  # a 16 GiB card with an idle, unwanted qwen3:8b on it
        gpus["4080"] = GpuView("4080", 16 * GiB, 10 * GiB, (QWEN8,))
        copies.append(stopped_on("4080"))
    return View(NOW, {"qwen3-14b": tuple(copies), "qwen3-14b-spare": (spare(calls),)}, gpus,
                book)


def decide(view: View, route: Route = ROUTE, claims: list[ClaimInfo] = CLAIMS,
           prompt: PromptNeed | None = None) -> object:
    return choose(route, rank(route, claims, view.largest_card), view, prompt)


def test_the_seeds_figures_unloading_the_wanted_32b_costs_about_26_s_queueing_15_s() -> None:
    unload = 12.0 + victim_cost(QWEN32.frees, QWEN32.demand)  # load + unload 1 s + 27 s x 0.5
    assert 26.0 <= unload <= 27.0
    assert queue_wait((NOW - 5.0,), 0, 1, 20.0, NOW) == 15.0
    assert queue_wait((NOW - 5.0,), 4, 1, 20.0, NOW) == 95.0  # five calls there
    assert 12.0 + victim_cost(QWEN8.frees, QWEN8.demand) == 13.0


def test_the_call_queues_at_the_busy_14b_rather_than_unload_the_wanted_32b() -> None:
    got = decide(seed_view(1, with_8b=False))
    assert isinstance(got, Choice)
    assert (got.kind, got.candidate, got.gpu, got.expected_s) == (
        Kind.QUEUED, "qwen3-14b-spare", "4090", 15.0)


def test_five_calls_queued_lose_to_unloading_an_idle_unwanted_8b() -> None:
    got = decide(seed_view(5, with_8b=True))
    assert isinstance(got, Choice)
    assert (got.kind, got.candidate, got.gpu, got.victim_names, got.expected_s) == (
        Kind.MADE_ROOM, "qwen3-14b", "4080", ("qwen3-8b",), 13.0)


def test_five_calls_queued_lose_even_to_the_26_s_unload_of_the_wanted_32b() -> None:
    got = decide(seed_view(5, with_8b=False))
    assert isinstance(got, Choice) and got.kind is Kind.MADE_ROOM  # 26.5 s < 95 s
    assert got.victim_names == ("qwen3-32b",) and 26.0 <= got.expected_s <= 27.0


def test_a_second_plan_for_the_same_victim_is_refused_and_the_next_call_plans_elsewhere() -> None:
    view = seed_view(5, with_8b=True)
    first = decide(view)
    assert isinstance(first, Choice)
    plan = plan_for(first, "p1", NOW + 180)
    assert plan is not None and plan.victims == {"qwen3-8b": 6 * GiB}
    gpu = view.gpus["4080"]
    book = view.book.claim(plan, gpu.free, gpu.resident)
    assert book is not None
    # A planner that read the same state picked the same victim: its claim must fail.
    rival = plan_for(first, "p2", NOW + 180)
    assert rival is not None and book.claim(rival, gpu.free, gpu.resident) is None
    # With the first plan in the book, the 8B is spoken for: the next call unloads the 32B.
    again = decide(seed_view(5, with_8b=True, book=book))
    assert isinstance(again, Choice)
    assert (again.kind, again.gpu, again.victim_names) == (Kind.MADE_ROOM, "5090",
                                                           ("qwen3-32b",))
    assert book.release("p1").plans == () and book.live(NOW + 181).plans == ()


# The steps before the queue-or-unload decision.
def tiered(tolerance: float) -> tuple[Route, list[ClaimInfo]]:
    route = Route("chat", tolerance=tolerance, prefer=(
        Prefer(100, LabelSelector({"size": "big"})), Prefer(95, LabelSelector({"size": "near"})),
        Prefer(50, LabelSelector({"size": "far"}))))
    return route, [ClaimInfo("big", {"size": "big"}, 20 * GiB),
                   ClaimInfo("near", {"size": "near"}, 9 * GiB),
                   ClaimInfo("far", {"size": "far"}, 5 * GiB)]


def warm(engine: str, gpu: str = "g1", **kw: object) -> Copy:
    return Copy(engine, "agent-a", gpu, CopyState.ACTIVE, slots=4, **kw)  # type: ignore[arg-type]


def asleep(engine: str, gpu: str = "g0", needs: int = 20 * GiB, **kw: object) -> Copy:
    return Copy(engine, "agent-a", gpu, CopyState.ASLEEP, needs=needs, size=needs,
                **kw)  # type: ignore[arg-type]


ROOMY = {"g0": GpuView("g0", 80 * GiB, 60 * GiB), "g1": GpuView("g1", 80 * GiB, 60 * GiB)}


def test_a_warm_candidate_within_tolerance_serves_while_the_preferred_one_sleeps() -> None:
    route, claims = tiered(10.0)
    view = View(NOW, {"big": (asleep("big"),), "near": (warm("near"),), "far": (warm("far"),)},
                ROOMY)
    got = decide(view, route, claims)
    assert isinstance(got, Choice) and (got.kind, got.candidate) == (Kind.WARM, "near")


def test_with_tolerance_0_the_preferred_one_is_woken() -> None:
    route, claims = tiered(0.0)
    view = View(NOW, {"big": (asleep("big", bring_up_s=3.0),), "near": (warm("near"),)}, ROOMY)
    got = decide(view, route, claims)
    assert isinstance(got, Choice)
    assert (got.kind, got.candidate, got.expected_s, got.needs) == (Kind.WOKEN, "big", 3.0,
                                                                    20 * GiB)


def test_a_candidate_outside_the_tolerance_is_not_used_warm() -> None:
    route, claims = tiered(10.0)
    view = View(NOW, {"big": (asleep("big"),), "far": (warm("far"),)}, ROOMY)
    got = decide(view, route, claims)
    assert isinstance(got, Choice) and (got.kind, got.candidate) == (Kind.WOKEN, "big")


def test_a_burst_converges_on_the_copy_being_woken() -> None:
    route, claims = tiered(10.0)
    waking = Copy("near", "agent-a", "g1", CopyState.WAKING)
    view = View(NOW, {"big": (asleep("big"),), "near": (waking,)}, ROOMY)
    got = decide(view, route, claims)
    assert isinstance(got, Choice) and (got.kind, got.candidate) == (Kind.CONVERGED, "near")


def test_a_warm_copy_another_plan_will_release_does_not_count_as_warm() -> None:
    route, claims = tiered(10.0)
    book = Book((Plan("p", "g1", "other", GiB, NOW + 60, {"near": 9 * GiB}),))
    view = View(NOW, {"big": (asleep("big"),), "near": (warm("near"),)}, ROOMY, book)
    got = decide(view, route, claims)
    assert isinstance(got, Choice) and (got.kind, got.candidate) == (Kind.WOKEN, "big")


def test_waking_wins_over_starting_when_it_is_quicker() -> None:
    route, claims = tiered(0.0)
    stopped = Copy("big@g1", "agent-a", "g1", CopyState.STOPPED, needs=20 * GiB, size=20 * GiB)
    view = View(NOW, {"big": (stopped, asleep("big", bring_up_s=2.0))}, ROOMY)
    got = decide(view, route, claims)
    assert isinstance(got, Choice) and (got.kind, got.engine) == (Kind.WOKEN, "big")


def test_a_route_whose_require_matches_nothing_is_refused_naming_the_selector() -> None:
    route = Route("chat", require=LabelSelector({"family": "llama"}))
    got = choose(route, rank(route, CLAIMS), View(NOW))
    assert isinstance(got, ZeroMatch) and got.status == 503 and got.retry_after is None
    assert "{family=llama}" in got.message


def test_a_model_too_large_for_every_gpu_is_refused_without_retry_after() -> None:
    route = Route("chat")
    claims = [ClaimInfo("huge", {}, 100 * GiB)]
    got = decide(View(NOW, {"huge": (asleep("huge", needs=100 * GiB),)}, ROOMY), route, claims)
    assert isinstance(got, ModelTooLarge) and (got.status, got.retry_after) == (503, None)
    assert "80.0 GiB usable" in got.message


def test_an_overlong_prompt_is_refused_before_anything_is_woken() -> None:
    route = Route("chat")
    claims = [ClaimInfo("small", {}, GiB, context=4096)]
    view = View(NOW, {"small": (asleep("small", needs=GiB),)}, ROOMY)
    got = decide(view, route, claims, PromptNeed(5000))
    assert isinstance(got, PromptTooLarge) and (got.status, got.code) == (
        400, "context_length_exceeded")
    assert "maximum context length is 4096 tokens" in got.message


def test_max_tokens_is_counted_as_each_engine_counts_it() -> None:
    assert context_needed(PromptNeed(4000, 200), "vllm") == 4000  # vLLM shortens the answer
    assert context_needed(PromptNeed(100, 5000), "vllm") == 5000  # and refuses this
    assert context_needed(PromptNeed(4000, 200), "sglang") == 4200
    assert context_needed(PromptNeed(4096), "sglang") == 4097  # a full context is refused
    assert context_needed(PromptNeed(4000, 200), "ollama") == 4000
    route = Route("chat")
    view = View(NOW, {"small": (warm("small"),)}, ROOMY)
    claims = [ClaimInfo("small", {}, GiB, context=4096, engine="sglang")]
    got = decide(view, route, claims, PromptNeed(4000, 200))
    assert isinstance(got, PromptTooLarge)
    assert "4200 tokens (4000 in the messages, 200 in the completion)" in got.message
    assert not isinstance(decide(view, route, [ClaimInfo("small", {}, GiB, context=4096)],
                                 PromptNeed(4000, 200)), PromptTooLarge)
    got = decide(view, route, [ClaimInfo("small", {}, GiB, context=4096)], PromptNeed(10, 5000))
    assert isinstance(got, PromptTooLarge)
    assert "requested 5000 tokens for the completion alone" in got.message


def test_a_prompt_too_long_for_the_preferred_one_goes_to_a_candidate_that_holds_it() -> None:
    route = Route("chat")
    claims = [ClaimInfo("short", {}, GiB, context=2048), ClaimInfo("long", {}, 2 * GiB,
                                                                 context=32768)]
    view = View(NOW, {"short": (warm("short"),), "long": (asleep("long", needs=2 * GiB),)},
                ROOMY)
    got = decide(view, route, claims, PromptNeed(3000))
    assert isinstance(got, Choice) and (got.kind, got.candidate) == (Kind.WOKEN, "long")


def test_with_no_room_and_no_queue_the_call_is_busy_with_a_retry_after() -> None:
    route = Route("chat")
    claims = [ClaimInfo("m", {}, 20 * GiB)]
    busy = Occupant("other", 70 * GiB, in_flight=1, idle_since=None)
    gpus = {"g0": GpuView("g0", 80 * GiB, 10 * GiB, (busy,))}
    got = decide(View(NOW, {"m": (asleep("m"),)}, gpus), route, claims)
    assert isinstance(got, Busy) and got.status == 503 and got.retry_after == 20


# A view that does not know the memory (the door's): bringing the preferred up is weighed
# against the queue at a full warm copy in tolerance.
def full(engine: str, started: float, latency_s: float | None) -> Copy:
    return Copy(engine, "agent-a", "g1", CopyState.ACTIVE, slots=1, in_flight=(started,),
                latency_s=latency_s)


@pytest.mark.parametrize(("latency_s", "kind", "candidate", "expected_s"), [
    (2.0, Kind.QUEUED, "near", 1.5),  # 1.5 s left of near's call beats a 3 s wake
    (None, Kind.WOKEN, "big", 3.0),  # none seen: 30 s, less the 0.5 s gone, loses to it
    (3.5, Kind.QUEUED, "near", 3.0),  # 3 s left against a 3 s wake: the queue is no longer
    (4.0, Kind.WOKEN, "big", 3.0),  # 3.5 s left: the wake is sooner
])
def test_where_room_is_unknown_a_full_warm_copy_queues_the_call_when_that_is_sooner(
        latency_s: float | None, kind: Kind, candidate: str, expected_s: float) -> None:
    route, claims = tiered(10.0)
    copies = {"big": (asleep("big", needs=0, bring_up_s=3.0),),
              "near": (full("near", NOW - 0.5, latency_s),)}
    gpus = {"g0": GpuView("g0", None, 0), "g1": GpuView("g1", None, 0)}
    got = decide(View(NOW, copies, gpus, room_unknown=True), route, claims)
    assert isinstance(got, Choice)
    assert (got.kind, got.candidate, got.expected_s) == (kind, candidate, expected_s)
    known = decide(View(NOW, copies, gpus), route, claims)  # memory known free: woken, as ever
    assert isinstance(known, Choice) and known.kind is Kind.WOKEN
