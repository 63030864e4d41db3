"""Admission: where a start or wake goes, and why it is refused when it cannot go anywhere."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.reasons import INSUFFICIENT_GPU, INSUFFICIENT_HOST, TOO_LARGE
from runtime_agent.gpu.admission import Admit, Refuse, admit, admit_sleep, claim
from runtime_agent.gpu.host_ledger import HostLedger
from runtime_agent.gpu.ledger import (
    GpuLedger,
    LedgerRefusal,
    measure,
    new_ledger,
    observe,
    reserve,
    set_sleeping,
)
from runtime_agent.gpu.model import Device

GIB = 1024**3


def cards(*sizes_gib: int, reserve_gib: int = 0) -> GpuLedger:
    return new_ledger({i: s * GIB for i, s in enumerate(sizes_gib)}, reserve_gib * GIB)


def held(ledger: GpuLedger, key: str, device: int | list[int], gib: int) -> GpuLedger:
    result = reserve(ledger, key, device, gib * GIB)
    assert not isinstance(result, LedgerRefusal)
    return measure(result[0], key, None)


# ---- device choice --------------------------------------------------------------------------

def test_one_card_goes_where_the_most_room_is_left() -> None:
    ledger = held(held(cards(80, 80, 80), "a", 0, 50), "b", 1, 10)
    assert admit(20 * GIB, 1, ledger) == Admit((2,))
    ledger = held(ledger, "c", 2, 30)
    assert admit(20 * GIB, 1, ledger) == Admit((1,))


def test_ties_go_to_the_lower_index() -> None:
    assert admit(GIB, 1, cards(80, 80)) == Admit((0,))
    assert admit(GIB, 2, cards(80, 80, 80, 80)) == Admit((0, 1))


def test_engines_that_declare_nothing_spread_over_the_cards() -> None:
    ledger = cards(80, 80, 80, 80)
    placed = []
    for n in range(8):  # undeclared: charged nothing, so room never tells the cards apart
        result = claim(0, 1, ledger, f"e{n}")
        assert not isinstance(result, Refuse)
        ledger, decision = result
        placed.append(decision.devices[0])
    assert placed == [0, 1, 2, 3, 0, 1, 2, 3]


@given(st.integers(1, 40), st.integers(1, 8))
def test_undeclared_engines_never_pile_up_on_one_card(engines: int, n_cards: int) -> None:
    ledger = cards(*([80] * n_cards))
    for n in range(engines):
        result = claim(0, 1, ledger, f"e{n}")
        assert not isinstance(result, Refuse)
        ledger = result[0]
    counts = [sum(1 for h in ledger.holdings.values() if d in h.devices) for d in range(n_cards)]
    assert max(counts) - min(counts) <= 1


def test_n_cards_are_the_n_with_the_most_room_in_index_order() -> None:
    ledger = held(held(cards(80, 80, 80, 80), "a", 1, 50), "b", 2, 5)
    assert admit(20 * GIB, 2, ledger) == Admit((0, 3))
    assert admit(20 * GIB, 3, ledger) == Admit((0, 2, 3))


def test_allowed_cards_restrict_the_choice() -> None:
    ledger = cards(80, 80, 80)
    assert admit(GIB, 1, ledger, allowed={2}) == Admit((2,))


# ---- too large ------------------------------------------------------------------------------

def test_more_than_any_card_offers_is_too_large_with_the_numbers() -> None:
    refused = admit(79 * GIB, 1, cards(80, 80, reserve_gib=2))
    assert isinstance(refused, Refuse) and refused.reason == TOO_LARGE
    assert "79.0 GiB" in refused.message and "78.0 GiB" in refused.message
    assert "80.0 GiB total less 2.0 GiB reserve" in refused.message
    assert (refused.needed, refused.free, refused.holders) == (79 * GIB, 78 * GIB, ())


def test_too_large_ignores_what_is_in_use_now() -> None:
    busy = held(cards(80), "a", 0, 70)
    refused = admit(20 * GIB, 1, busy)
    assert isinstance(refused, Refuse) and refused.reason == INSUFFICIENT_GPU


def test_more_cards_than_the_pod_has_is_too_large() -> None:
    refused = admit(GIB, 4, cards(80, 80))
    assert isinstance(refused, Refuse) and refused.reason == TOO_LARGE
    assert "only 2 GPU(s)" in refused.message


def test_too_few_large_cards_is_too_large() -> None:
    refused = admit(60 * GIB, 2, cards(80, 40, 40))
    assert isinstance(refused, Refuse) and refused.reason == TOO_LARGE
    assert "only 1 of the 3 GPUs" in refused.message


# ---- not now --------------------------------------------------------------------------------

def test_insufficient_memory_names_needed_free_and_holders_largest_first() -> None:
    ledger = held(held(held(cards(80), "small", 0, 10), "big", 0, 40), "mid", 0, 20)
    ledger = observe(ledger, [Device(0, "u", "n", 80 * GIB, 8 * GIB, 72 * GIB, None)],
                     {0: 2 * GIB})
    refused = admit(30 * GIB, 1, ledger)
    assert isinstance(refused, Refuse) and refused.reason == INSUFFICIENT_GPU
    assert refused.needed == 30 * GIB and refused.free == 8 * GIB
    assert refused.holders == (("big", 40 * GIB), ("mid", 20 * GIB), ("small", 10 * GIB))
    assert refused.message == (
        "needs 30.0 GiB on each of 1 GPU, but not now (GPU 0: 8.0 GiB free); held by big "
        "40.0 GiB, mid 20.0 GiB, small 10.0 GiB, other processes 2.0 GiB")


def test_multi_card_refusal_reports_the_best_cards() -> None:
    ledger = held(held(cards(80, 80, 80), "a", [0, 1], 60), "b", 2, 70)
    refused = admit(30 * GIB, 2, ledger)
    assert isinstance(refused, Refuse) and refused.reason == INSUFFICIENT_GPU
    assert refused.free == 20 * GIB and refused.holders == (("a", 120 * GIB),)


def test_a_wake_counts_its_own_charge_and_stays_on_its_cards() -> None:
    ledger = measure(held(cards(80, 80), "a", 1, 60), "a", 60 * GIB)
    ledger = measure(set_sleeping(ledger, "a", True), "a", 2 * GIB)
    ledger = held(ledger, "b", 1, 30)
    refused = admit(60 * GIB, 1, ledger, key="a")
    assert isinstance(refused, Refuse) and refused.reason == INSUFFICIENT_GPU
    assert refused.free == 50 * GIB and refused.holders == (("b", 30 * GIB),)  # not itself
    assert admit(50 * GIB, 1, ledger, key="a") == Admit((1,))


def test_claim_admits_and_reserves_in_one_step() -> None:
    ledger = cards(80, 80)
    result = claim(50 * GIB, 1, ledger, "a", declared_bytes=45 * GIB)
    assert not isinstance(result, Refuse)
    ledger, decision = result
    assert decision == Admit((0,)) and ledger.charge("a", 0) == 50 * GIB
    assert ledger.holdings["a"].declared_bytes == 45 * GIB
    second = claim(50 * GIB, 1, ledger, "b")
    assert not isinstance(second, Refuse) and second[1] == Admit((1,))
    third = claim(50 * GIB, 1, second[0], "c")
    assert isinstance(third, Refuse) and third.reason == INSUFFICIENT_GPU


def test_bad_requests_are_errors() -> None:
    with pytest.raises(ValueError):
        admit(-1, 1, cards(80))
    with pytest.raises(ValueError):
        admit(GIB, 0, cards(80))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=4),
       st.lists(st.tuples(st.integers(1, 60), st.integers(1, 3)), max_size=12))
def test_admitted_claims_always_fit_and_refusals_are_right(sizes: list[int],
                                                           requests: list[tuple[int, int]]) -> None:
    ledger = new_ledger(dict(enumerate(sizes)))
    for i, (need, n) in enumerate(requests):
        result = claim(need, n, ledger, f"e{i}")
        if isinstance(result, Refuse):
            usable = sorted(sizes, reverse=True)
            if n > len(sizes) or usable[n - 1] < need:
                assert result.reason == TOO_LARGE
            else:
                assert result.reason == INSUFFICIENT_GPU
                assert sum(1 for d in ledger.devices if ledger.room(d) >= need) < n
            continue
        ledger, decision = result
        assert len(decision.devices) == n
        for d in ledger.devices:
            assert ledger.committed(d) <= ledger.devices[d].usable_bytes


# ---- sleeping -------------------------------------------------------------------------------

def test_level_one_sleep_needs_host_room_for_the_weights() -> None:
    host = HostLedger(64 * GIB, reserve_bytes=4 * GIB, external_bytes=10 * GIB,
                      holdings={"other": 30 * GIB})
    refused = admit_sleep(1, 30 * GIB, host, "a")
    assert isinstance(refused, Refuse) and refused.reason == INSUFFICIENT_HOST
    assert refused.needed == 30 * GIB and refused.free == 20 * GIB
    assert refused.holders == (("other", 30 * GIB),)
    assert "level-2 sleep needs no host memory" in refused.message
    admitted = admit_sleep(1, 20 * GIB, host, "a")
    assert isinstance(admitted, HostLedger) and admitted.holdings["a"] == 20 * GIB


def test_level_two_sleep_always_fits() -> None:
    host = HostLedger(GIB)
    assert admit_sleep(2, 100 * GIB, host, "a") is host
    with pytest.raises(ValueError):
        admit_sleep(3, GIB, host, "a")
