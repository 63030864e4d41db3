"""The GPU and host memory ledgers: claims never over-commit a card, measurements replace claims."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_agent.gpu.attribution import EngineMemory
from runtime_agent.gpu.host_ledger import (
    HostLedger,
    HostRefusal,
    host_measure,
    host_observe,
    host_release,
    host_reserve,
)
from runtime_agent.gpu.ledger import (
    GpuLedger,
    LedgerRefusal,
    Reservation,
    declare,
    forget,
    ledger_for,
    measure,
    new_ledger,
    observe,
    refresh,
    release,
    reserve,
    set_sleeping,
)
from runtime_agent.gpu.model import Device

pytestmark = pytest.mark.loop_guard  # the in-process core must not block its loop

GIB = 1024**3


def ok(result: tuple[GpuLedger, Reservation] | LedgerRefusal) -> GpuLedger:
    assert not isinstance(result, LedgerRefusal), result
    return result[0]


def two_cards(reserve_bytes: int = 0) -> GpuLedger:
    return new_ledger({0: 80 * GIB, 1: 80 * GIB}, reserve_bytes)


# ---- budgets --------------------------------------------------------------------------------

def test_usable_is_total_less_the_reserve() -> None:
    ledger = two_cards(reserve_bytes=2 * GIB)
    assert ledger.devices[0].usable_bytes == 78 * GIB and ledger.free(0) == 78 * GIB
    with pytest.raises(ValueError):
        new_ledger({0: GIB}, reserve_bytes=-1)


def test_observe_takes_sizes_and_external_memory() -> None:
    ledger = ledger_for([Device(0, "u", "n", 80 * GIB, 80 * GIB, 0, None)], reserve_bytes=GIB)
    seen = observe(ledger, [Device(0, "u", "n", 80 * GIB, 70 * GIB, 10 * GIB, None),
                            Device(1, "v", "n", 40 * GIB, 40 * GIB, 0, None)], {0: 3 * GIB})
    assert seen.devices[0].external_bytes == 3 * GIB and seen.free(0) == 76 * GIB
    assert seen.devices[1].reserve_bytes == GIB and seen.devices[1].usable_bytes == 39 * GIB
    assert observe(seen, [], {}) == seen  # a failed sample changes nothing


# ---- claims ---------------------------------------------------------------------------------

def test_a_claim_is_charged_at_once_and_refused_when_it_does_not_fit() -> None:
    ledger = ok(reserve(two_cards(), "a", 0, 50 * GIB))
    assert ledger.charge("a", 0) == 50 * GIB and ledger.free(0) == 30 * GIB
    refusal = reserve(ledger, "b", 0, 40 * GIB)
    assert refusal == LedgerRefusal("b", 0, 40 * GIB, 30 * GIB)
    ledger = ok(reserve(ledger, "b", 1, 40 * GIB))
    assert ledger.holders([0, 1]) == [("a", 50 * GIB), ("b", 40 * GIB)]


def test_multi_card_claims_are_all_or_nothing() -> None:
    ledger = ok(reserve(two_cards(), "a", 1, 60 * GIB))
    refusal = reserve(ledger, "tp", [0, 1], 30 * GIB)
    assert isinstance(refusal, LedgerRefusal) and refusal.device == 1
    assert "tp" not in ledger.holdings and ledger.free(0) == 80 * GIB


def test_two_claims_on_the_same_free_bytes_never_both_succeed() -> None:
    ledger = two_cards()
    first = reserve(ledger, "a", 0, 60 * GIB)
    assert not isinstance(first, LedgerRefusal)
    second = reserve(first[0], "b", 0, 60 * GIB)  # made on the ledger the first claim produced
    assert isinstance(second, LedgerRefusal)


async def test_concurrent_claimers_sharing_one_ledger_get_one_card_each_time() -> None:
    state = {"ledger": new_ledger({0: 80 * GIB})}
    won: list[str] = []

    async def claimer(name: str) -> None:
        await asyncio.sleep(0)  # interleave the tasks
        result = reserve(state["ledger"], name, 0, 50 * GIB)  # decide and store: no await between
        if not isinstance(result, LedgerRefusal):
            state["ledger"] = result[0]
            won.append(name)

    await asyncio.gather(*(claimer(f"e{i}") for i in range(10)))
    assert len(won) == 1 and state["ledger"].committed(0) == 50 * GIB


def test_release_drops_a_claim_whose_engine_never_came_up() -> None:
    ledger = ok(reserve(two_cards(), "a", 0, 50 * GIB))
    assert release(ledger, "a").holdings == {} and release(ledger, "zz") is ledger


def test_bad_arguments_are_errors_not_refusals() -> None:
    ledger = two_cards()
    for devices in ([], [0, 0], [5]):
        with pytest.raises(ValueError):
            reserve(ledger, "a", devices, GIB)
    with pytest.raises(ValueError):
        reserve(ledger, "a", 0, -1)
    ledger = ok(reserve(ledger, "a", 0, GIB))
    with pytest.raises(ValueError, match="holds devices"):
        reserve(ledger, "a", 1, GIB)
    with pytest.raises(KeyError):
        measure(ledger, "nobody", GIB)
    with pytest.raises(KeyError):
        set_sleeping(ledger, "nobody", True)


# ---- declared, then measured ----------------------------------------------------------------

def test_declared_then_measured() -> None:
    ledger = ok(reserve(two_cards(), "a", [0, 1], 40 * GIB, declared_bytes=40 * GIB))
    ledger = refresh(ledger, "a", {0: 10 * GIB, 1: 10 * GIB})  # still loading: the claim holds
    assert ledger.charge("a", 0) == 40 * GIB
    ledger = measure(ledger, "a", EngineMemory(70 * GIB, {0: 35 * GIB, 1: 35 * GIB}, (0, 1)))
    assert ledger.charge("a", 0) == 35 * GIB and ledger.holdings["a"].claim_bytes == 0
    ledger = measure(ledger, "a", {0: 36 * GIB, 1: None})  # unknown on card 1: keep 35
    assert (ledger.charge("a", 0), ledger.charge("a", 1)) == (36 * GIB, 35 * GIB)
    assert release(ledger, "a").charge("a", 0) == 36 * GIB  # a running engine keeps its base
    assert forget(ledger, "a").holdings == {}


def test_an_engine_that_cannot_be_measured_is_charged_its_declaration() -> None:
    ledger = ok(reserve(two_cards(), "a", 0, 30 * GIB, declared_bytes=25 * GIB))
    ledger = measure(ledger, "a", None)
    assert ledger.charge("a", 0) == 25 * GIB


def test_an_int_measurement_is_split_over_the_cards() -> None:
    ledger = measure(ok(reserve(two_cards(), "a", [0, 1], 40 * GIB)), "a", 60 * GIB + 1)
    assert (ledger.charge("a", 0), ledger.charge("a", 1)) == (30 * GIB + 1, 30 * GIB)


def test_a_readopted_engine_is_declared_and_may_exceed_the_budget() -> None:
    ledger = declare(two_cards(), "old", 0, 90 * GIB)
    assert ledger.room(0) == -10 * GIB and ledger.free(0) == 0
    assert isinstance(reserve(ledger, "new", 0, 1), LedgerRefusal)
    ledger = measure(ledger, "old", 70 * GIB)
    assert ledger.free(0) == 10 * GIB


# ---- sleep and wake -------------------------------------------------------------------------

def test_sleeping_engines_are_charged_their_measured_sleeping_footprint() -> None:
    ledger = measure(ok(reserve(two_cards(), "a", 0, 60 * GIB)), "a", 58 * GIB)
    ledger = set_sleeping(ledger, "a", True)
    assert ledger.charge("a", 0) == 58 * GIB  # not yet measured asleep: the awake figure
    ledger = measure(ledger, "a", GIB)
    assert ledger.charge("a", 0) == GIB and ledger.holdings["a"].wake_need(0) == 58 * GIB
    other = ok(reserve(ledger, "b", 0, 70 * GIB))
    # the wake claims its awake footprint back; only its growth must fit
    assert isinstance(reserve(other, "a", 0, 58 * GIB), LedgerRefusal)
    woken = ok(reserve(ledger, "a", 0, 58 * GIB))
    assert woken.charge("a", 0) == 58 * GIB
    woken = measure(set_sleeping(woken, "a", False), "a", 59 * GIB)
    assert woken.charge("a", 0) == 59 * GIB and woken.holdings["a"].wake_need(0) == 59 * GIB


def test_a_sleeping_engine_never_measured_is_charged_its_declaration() -> None:
    ledger = declare(two_cards(), "a", 0, 40 * GIB, sleeping=True)
    assert ledger.charge("a", 0) == 40 * GIB
    failed_wake = release(ok(reserve(ledger, "a", 0, 50 * GIB)), "a")
    assert failed_wake.charge("a", 0) == 40 * GIB


# ---- the property ---------------------------------------------------------------------------

KEYS = ["a", "b", "c", "d"]
ops = st.lists(st.one_of(
    st.tuples(st.just("reserve"), st.sampled_from(KEYS),
              st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True),
              st.integers(0, 100)),
    st.tuples(st.just("measure"), st.sampled_from(KEYS), st.integers(0, 100)),
    st.tuples(st.just("refresh"), st.sampled_from(KEYS), st.integers(0, 100)),
    st.tuples(st.just("release"), st.sampled_from(KEYS)),
    st.tuples(st.just("forget"), st.sampled_from(KEYS)),
    st.tuples(st.just("sleep"), st.sampled_from(KEYS), st.booleans()),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(0, 10), st.lists(st.integers(0, 30), min_size=3, max_size=3))
def test_claims_never_over_commit_a_card(steps: list[tuple[object, ...]], reserve_bytes: int,
                                         external: list[int]) -> None:
    """Engines use at most what they claimed (measurements are capped by the claim), so reality
    never exceeds a budget by itself; then no sequence of operations over-commits a card."""
    sizes = {0: 100, 1: 80, 2: 60}
    ledger = observe(new_ledger(sizes, reserve_bytes),
                     [Device(i, "u", "n", t, t, 0, None) for i, t in sizes.items()],
                     dict(enumerate(external)))
    for step in steps:
        kind, key = step[0], str(step[1])
        holding = ledger.holdings.get(key)
        if kind == "reserve":
            devices, amount = list(step[2]), int(step[3])  # type: ignore[call-overload]
            if holding is not None:
                devices = list(holding.devices)
            result = reserve(ledger, key, devices, amount)
            if isinstance(result, LedgerRefusal):
                assert result.needed > ledger.room(result.device)
            else:
                ledger = result[0]
        elif holding is None:
            continue
        elif kind in ("measure", "refresh"):
            cap = max(holding.charge(d) for d in holding.devices)
            value = min(int(step[2]), cap)  # type: ignore[call-overload]
            fn = measure if kind == "measure" else refresh
            ledger = fn(ledger, key, {d: value for d in holding.devices})
        elif kind == "release":
            ledger = release(ledger, key)
        elif kind == "forget":
            ledger = forget(ledger, key)
        else:
            ledger = set_sleeping(ledger, key, bool(step[2]))
        for d in sizes:
            charges = sum(h.charge(d) for h in ledger.holdings.values())
            assert charges + ledger.devices[d].external_bytes <= ledger.devices[d].usable_bytes


# ---- host memory ----------------------------------------------------------------------------

def test_host_claims_fit_or_are_refused() -> None:
    host = host_observe(HostLedger(100 * GIB, reserve_bytes=10 * GIB), 100 * GIB, 20 * GIB)
    assert host.free == 70 * GIB
    host2 = host_reserve(host, "a", 50 * GIB)
    assert isinstance(host2, HostLedger) and host2.free == 20 * GIB
    assert host_reserve(host2, "b", 30 * GIB) == HostRefusal("b", 30 * GIB, 20 * GIB)
    assert isinstance(host_reserve(host2, "a", 60 * GIB), HostLedger)  # growth of 10 fits
    measured = host_measure(host2, "a", 45 * GIB)
    assert measured.holdings == {"a": 45 * GIB} and host_measure(measured, "a", None) == measured
    assert host_release(measured, "a").holdings == {}
    assert host_measure(host, "old", 5 * GIB).holdings == {"old": 5 * GIB}
    assert host2.holders() == [("a", 50 * GIB)]
    with pytest.raises(ValueError):
        host_reserve(host, "a", -1)
