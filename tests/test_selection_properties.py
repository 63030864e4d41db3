"""Properties of route choice over random pools (hypothesis): a warm candidate within tolerance
always wins over bringing the preferred one up; no victim has a request in flight or a waiter;
two plans never spend one victim's credit; the candidate order is the seed's rule."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.quantity import GiB
from reconciler.model.selector import LabelSelector
from reconciler.selection.candidates import ClaimInfo, Ranked, rank
from reconciler.selection.choice import Choice, Kind, choose, plan_for
from reconciler.selection.delay import Demand, queue_wait
from reconciler.selection.reservations import Book, Plan
from reconciler.selection.route_spec import Prefer, Route
from reconciler.selection.victims import Occupant, choose_victims
from reconciler.selection.view import Copies, Copy, CopyState, GpuView, View

pytestmark = pytest.mark.timeout(120)
NOW = 1_000.0
IDLE_AFTER = 30.0
KEYS, VALUES = ("family", "params", "tier"), ("a", "b", "c")

labels_st = st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=3)
claims_st = st.lists(st.builds(ClaimInfo, name=st.text("xyz", min_size=1, max_size=4),
                               labels=labels_st,
                               footprint=st.one_of(st.none(), st.integers(1, 8).map(
                                   lambda n: n * GiB))),
                     min_size=1, max_size=12, unique_by=lambda c: c.name)
prefer_st = st.lists(st.builds(Prefer, weight=st.integers(1, 100),
                               selector=st.builds(LabelSelector, labels_st)), max_size=4)


def seed_order(route: Route, claims: list[ClaimInfo], largest: int | None) -> list[str]:
    """The seed's rule, written out again: score, then declared footprint (none declared
    last), then name; the first that fits some GPU moves to the front."""
    def score(c: ClaimInfo) -> int:
        return sum(p.weight for p in route.prefer
                   if all(c.labels.get(k) == v for k, v in p.selector.match_labels.items()))

    def before(a: ClaimInfo, b: ClaimInfo) -> int:
        if score(a) != score(b):
            return score(b) - score(a)
        if (a.footprint is None) != (b.footprint is None):
            return 1 if a.footprint is None else -1
        if a.footprint != b.footprint:
            return (a.footprint or 0) - (b.footprint or 0)
        return (a.name > b.name) - (a.name < b.name)

    admitted = sorted((c for c in claims if route.require.matches(c.labels)),
                      key=functools.cmp_to_key(before))
    fitting = [c for c in admitted if largest is None or c.footprint is None
               or c.footprint <= largest]
    if fitting:
        admitted.remove(fitting[0])
        admitted.insert(0, fitting[0])
    return [c.name for c in admitted]


@given(claims_st, prefer_st, labels_st, st.one_of(st.none(), st.integers(1, 8).map(
    lambda n: n * GiB)))
def test_the_candidate_order_is_the_seeds_rule_for_any_labels_and_weights(
        claims: list[ClaimInfo], prefer: list[Prefer], require: dict[str, str],
        largest: int | None) -> None:
    route = Route("r", require=LabelSelector(require), prefer=tuple(prefer))
    ranked = rank(route, claims, largest)
    assert [r.name for r in ranked] == seed_order(route, claims, largest)


@st.composite
def pools(draw: st.DrawFn, states: list[CopyState] | None = None
          ) -> tuple[Route, tuple[Ranked, ...], View]:
    """A route over random claims, each with up to two copies (in ``states``) on up to three
    16 GiB GPUs full of random occupants."""
    claims = draw(claims_st)
    prefer = draw(prefer_st)
    route = Route("r", prefer=tuple(prefer), tolerance=draw(st.sampled_from([0.0, 10.0, 50.0])))
    gpus: dict[str, GpuView] = {}
    for g in range(draw(st.integers(1, 3))):
        occupants = tuple(
            Occupant(f"occ{g}-{i}", draw(st.integers(1, 8)) * GiB,
                     in_flight=draw(st.sampled_from([0, 0, 0, 1, 2])),
                     idle_since=draw(st.sampled_from([None, NOW - 5.0, NOW - 100.0,
                                                      NOW - 100.0])),
                     demand=Demand(waiters=draw(st.sampled_from([0, 0, 0, 1])),
                                   recent_use=draw(st.floats(0, 3))))
            for i in range(draw(st.integers(0, 4))))
        usable = 16 * GiB
        used = sum(o.frees for o in occupants)
        gpus[f"g{g}"] = GpuView(f"g{g}", usable, max(0, usable - used), occupants)
    copies: dict[str, tuple[Copy, ...]] = {}
    for c in claims:
        n = draw(st.integers(0, 2))
        copies[c.name] = tuple(
            Copy(f"{c.name}#{i}", "agent", draw(st.sampled_from(sorted(gpus))),
                 draw(st.sampled_from(states or list(CopyState))),
                 slots=draw(st.integers(1, 3)),
                 in_flight=tuple(NOW - draw(st.floats(0, 40)) for _ in
                                 range(draw(st.integers(0, 3)))),
                 queued=draw(st.integers(0, 2)), needs=(c.footprint or GiB), size=c.footprint
                 or GiB)
            for i in range(n))
    return route, rank(route, claims, 16 * GiB), View(NOW, copies, gpus, idle_after_s=IDLE_AFTER)


def warm_in_tolerance(route: Route, ranked: tuple[Ranked, ...], view: View) -> set[str]:
    pref = ranked[0]
    return {r.name for r in ranked if r.score >= pref.score - route.tolerance
            and (r.claim.footprint or 0) <= 16 * GiB
            and any(c.state is CopyState.ACTIVE and c.free_slot for c in view.copies[r.name])}


@given(pools())
def test_a_warm_candidate_within_tolerance_is_always_chosen_over_waking_the_preferred_one(
        pool: tuple[Route, tuple[Ranked, ...], View]) -> None:
    route, ranked, view = pool
    got = choose(route, ranked, view)
    if not ranked or (ranked[0].claim.footprint or 0) > 16 * GiB:
        return
    warm = warm_in_tolerance(route, ranked, view)
    if warm:
        assert isinstance(got, Choice) and got.kind is Kind.WARM and got.candidate in warm
    elif isinstance(got, Choice) and got.kind is Kind.WARM:
        pytest.fail(f"chose {got.candidate} warm, but no in-tolerance candidate had a free slot")


# Pools where nothing is coming up, so rooms must often be made.
NOTHING_LOADING = [CopyState.ACTIVE, CopyState.ASLEEP, CopyState.STOPPED, CopyState.STOPPED]


@settings(max_examples=300)
@given(pools(NOTHING_LOADING))
def test_no_victim_has_a_request_in_flight_or_a_waiter(
        pool: tuple[Route, tuple[Ranked, ...], View]) -> None:
    route, ranked, view = pool
    got = choose(route, ranked, view)
    if not isinstance(got, Choice) or got.kind is not Kind.MADE_ROOM:
        return
    occupants = {o.name: o for g in view.gpus.values() for o in g.occupants}
    assert got.victims
    for name in got.victim_names:
        o = occupants[name]
        assert o.in_flight == 0 and o.demand.waiters == 0
        assert o.idle_since is not None and NOW - o.idle_since >= IDLE_AFTER


occupants_st = st.lists(st.builds(
    Occupant, name=st.text("abcdef", min_size=1, max_size=3), frees=st.integers(1, 9),
    in_flight=st.integers(0, 1), idle_since=st.sampled_from([None, NOW - 5.0, NOW - 100.0]),
    demand=st.builds(Demand, waiters=st.integers(0, 1), intents=st.integers(0, 2),
                     recent_use=st.floats(0, 2))), max_size=7, unique_by=lambda o: o.name)


@given(occupants_st, st.integers(-2, 30))
def test_victims_are_idle_and_the_fewest_that_make_room(occupants: list[Occupant],
                                                        need: int) -> None:
    got = choose_victims(occupants, need, NOW, IDLE_AFTER)
    idle = [o for o in occupants if o.in_flight == 0 and o.demand.waiters == 0
            and o.idle_since is not None and NOW - o.idle_since >= IDLE_AFTER]
    fewest = next((k for k in range(len(idle) + 1) for combo in
                   itertools.combinations(idle, k) if sum(o.frees for o in combo) >= need),
                  None)
    if fewest is None:
        assert got is None
        return
    assert got is not None and len(got) == fewest and all(o in idle for o in got)
    assert need <= 0 or sum(o.frees for o in got) >= need


plan_st = st.builds(Plan, id=st.text("pq", min_size=1, max_size=3), gpu=st.just("g"),
                    model=st.just("m"), load=st.integers(1, 10), expires_at=st.just(NOW + 60),
                    victims=st.dictionaries(st.sampled_from("vwx"), st.integers(1, 6),
                                            max_size=2))


@given(st.lists(plan_st, max_size=8), st.integers(0, 8), st.sets(st.sampled_from("vwx")))
def test_two_concurrent_plans_never_spend_one_victims_credit(plans: list[Plan], free: int,
                                                             resident: set[str]) -> None:
    book = Book()
    sizes: dict[str, int] = {}
    for plan in plans:
        # A victim's size is a fact of the GPU: every planner sees the same one.
        plan = replace(plan, victims={v: sizes.setdefault(v, n) for v, n in
                                      plan.victims.items()})
        book = book.claim(plan, free, resident) or book
        credit = sum(n for v, n in sizes.items() if v in resident
                     and any(v in p.victims for p in book.plans))
        assert sum(p.load for p in book.plans) <= free + credit


@settings(max_examples=300)
@given(pools(NOTHING_LOADING), st.integers(1, 4))
def test_plans_made_one_after_another_never_share_a_victim(
        pool: tuple[Route, tuple[Ranked, ...], View], calls: int) -> None:
    route, ranked, view = pool
    for i in range(calls):
        got = choose(route, ranked, view)
        if not isinstance(got, Choice):
            return
        plan = plan_for(got, f"p{i}", NOW + 60)
        if plan is None:
            return
        gpu = view.gpus[plan.gpu]
        book = view.book.claim(plan, gpu.free, gpu.resident)
        assert book is not None, "a plan from a fresh view must fit the budget it was made for"
        view = View(NOW, view.copies, view.gpus, book, view.idle_after_s)
        names = [v for p in book.plans for v in p.victims]
        assert len(names) == len(set(names))


@given(pools(NOTHING_LOADING))
def test_a_queued_call_waits_for_the_soonest_in_tolerance_copy_by_the_seeds_formula(
        pool: tuple[Route, tuple[Ranked, ...], View]) -> None:
    route, ranked, view = pool
    got = choose(route, ranked, view)
    if not isinstance(got, Choice) or got.kind is not Kind.QUEUED or not ranked:
        return
    floor = ranked[0].score - route.tolerance
    waits = [queue_wait(c.in_flight, c.queued, c.slots, c.latency_s, NOW)
             for r in ranked if r.score >= floor and (r.claim.footprint or 0) <= 16 * GiB
             for c in view.copies[r.name] if c.state is CopyState.ACTIVE and not c.free_slot]
    assert got.expected_s == pytest.approx(min(waits))


@given(pools(), st.data())
def test_replacing_one_candidates_copies_gives_the_index_built_afresh(
        pool: tuple[Route, tuple[Ranked, ...], View], data: st.DataObject) -> None:
    _, ranked, view = pool
    index = view.index
    for _ in range(3):
        name = data.draw(st.sampled_from(sorted(index.all) or ["none"]))
        keep = data.draw(st.integers(0, len(index.get(name))))
        index = index.replaced(name, index.get(name)[:keep])
        fresh = Copies(index.all)
        assert (index.warm, index.loading, index.busy, index.queue_order) == (
            fresh.warm, fresh.loading, fresh.busy, fresh.queue_order)


busy_copy_st = st.builds(
    lambda slots, started, queued, latency: (slots, tuple(NOW - s for s in started[:slots]),
                                             queued, latency),
    st.integers(1, 3), st.lists(st.floats(0, 90), min_size=3, max_size=3), st.integers(0, 4),
    st.one_of(st.none(), st.floats(1, 60)))


@given(st.lists(busy_copy_st, min_size=1, max_size=20))
def test_the_queue_option_is_the_shortest_wait_over_every_busy_copy(
        busy: list[tuple[int, tuple[float, ...], int, float | None]]) -> None:
    claims = [ClaimInfo("pref", {}, GiB)] + [ClaimInfo(f"c{i:02d}", {}, GiB)
                                            for i in range(len(busy))]
    route = Route("r")  # no prefer: every score is 0, every candidate within tolerance
    copies = {"pref": (Copy("pref", "a", "nowhere", CopyState.ASLEEP, needs=GiB),)}
    for i, (slots, started, queued, latency) in enumerate(busy):
        copies[f"c{i:02d}"] = (Copy(f"c{i:02d}", "a", "g", CopyState.ACTIVE, slots=slots,
                                    in_flight=started, queued=queued, latency_s=latency),)
    got = choose(route, rank(route, claims), View(NOW, copies))
    waits = [queue_wait(c.in_flight, c.queued, c.slots, c.latency_s, NOW)
             for name, cs in copies.items() if name != "pref" for c in cs if not c.free_slot]
    if not waits:
        assert isinstance(got, Choice) and got.kind is Kind.WARM
        return
    assert isinstance(got, Choice) and got.kind is Kind.QUEUED
    assert got.expected_s == pytest.approx(min(waits))
