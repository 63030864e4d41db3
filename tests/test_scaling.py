"""Copies by demand: the pure step (``reconciler.planning.scaling.next_count``), the range in a
manifest, and the count the desired state keeps (``Lookups.scale``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.desired import Lookups
from reconciler.model.manifests import parse_manifests

from reconciler.planning.scaling import (
    DOWN_WITHOUT_SLEEP_S,
    SCALED_DOWN,
    SCALED_UP,
    UP_AFTER_S,
    Replica,
    down_after,
    next_count,
    queue_costs_more,
)
from tests.reconciler_fakes import claim_yaml

SERVING = Replica(0, True, None)


def copies(n: int, idle_last: float | None = None) -> list[Replica]:
    return [Replica(i, True, idle_last if i == n - 1 else None) for i in range(n)]


def test_a_queue_that_costs_more_than_a_load_for_long_enough_adds_a_copy() -> None:
    step = next_count(1, 3, copies(1), queue_s=40.0, load_s=6.0, over_for_s=UP_AFTER_S,
                      room=True, down_after_s=60)
    assert (step.count, step.reason) == (2, SCALED_UP)
    assert "40.0 s" in step.message and "6.0 s" in step.message


def test_no_copy_is_added_too_soon_without_room_at_the_maximum_or_while_one_comes_up() -> None:
    base = dict(queue_s=40.0, load_s=6.0, down_after_s=60.0)
    assert next_count(1, 3, copies(1), over_for_s=UP_AFTER_S / 2, room=True, **base).count == 1
    assert next_count(1, 3, copies(1), over_for_s=10, room=False, **base).count == 1
    assert next_count(1, 2, copies(2), over_for_s=10, room=True, **base).count == 2
    coming = [SERVING, Replica(1, False, None)]
    assert next_count(1, 3, coming, over_for_s=10, room=True, **base).count == 2


def test_the_highest_idle_extra_copy_goes_after_its_idle_time_never_below_the_minimum() -> None:
    step = next_count(1, 3, copies(2, idle_last=61.0), None, 6.0, 0.0, True, 60.0)
    assert (step.count, step.reason) == (1, SCALED_DOWN) and "copy 1" in step.message
    assert next_count(1, 3, copies(2, idle_last=59.0), None, 6.0, 0.0, True, 60.0).count == 2
    assert next_count(1, 3, copies(2, idle_last=None), None, 6.0, 0.0, True, 60.0).count == 2
    assert next_count(2, 3, copies(2, idle_last=1e6), None, 6.0, 0.0, True, 60.0).count == 2


def test_a_count_outside_an_edited_range_is_brought_inside_at_once() -> None:
    assert next_count(2, 3, copies(1), None, 6.0, 0.0, False, 60.0).count == 2
    assert next_count(1, 2, copies(4), None, 6.0, 0.0, False, 60.0).count == 2


def test_down_after_is_twice_the_sleep_idle_time_or_ten_minutes_without_one() -> None:
    assert down_after(30.0) == 60.0 and down_after(0.0) == DOWN_WITHOUT_SLEEP_S
    assert queue_costs_more(7.0, 6.0) and not queue_costs_more(6.0, 6.0)
    assert not queue_costs_more(None, 0.0)


@given(st.integers(1, 8), st.integers(0, 7), st.integers(1, 9),
       st.one_of(st.none(), st.floats(0, 1e4)), st.floats(0, 100), st.floats(0, 100),
       st.booleans(), st.lists(st.one_of(st.none(), st.floats(0, 1e4)), min_size=9,
                               max_size=9), st.lists(st.booleans(), min_size=9, max_size=9))
def test_a_step_moves_by_at_most_one_inside_the_range_and_only_up_with_room(
        minimum: int, extra: int, count: int, queue_s: float | None, load_s: float,
        over: float, room: bool, idles: list[float | None], serving: list[bool]) -> None:
    maximum = min(8, minimum + extra)
    replicas = [Replica(i, serving[i], idles[i]) for i in range(count)]
    step = next_count(minimum, maximum, replicas, queue_s, load_s, over, room, 60.0)
    assert minimum <= step.count <= maximum
    if minimum <= count <= maximum:
        assert abs(step.count - count) <= 1
        if step.count > count:
            assert room and all(serving[:count]) and over >= UP_AFTER_S
        if step.count < count:
            assert (idles[count - 1] or 0) >= 60.0 and idles[count - 1] is not None
        assert (step.reason == "") == (step.count == count)


# ---- the range in a manifest, and the count the desired state keeps -------------------------

def ranged_yaml(low: int, high: int | str) -> str:
    text = claim_yaml("c")
    return text.replace("  engine: vllm\n", f"  engine: vllm\n  replicas: {low}\n"
                        f"  maxReplicas: {high}\n")


def test_a_claim_may_ask_for_a_range_of_engines() -> None:
    (claim,) = parse_manifests(ranged_yaml(1, 3)).claims
    assert (claim.replicas, claim.replica_range) == (1, (1, 3))
    (fixed,) = parse_manifests(claim_yaml("c")).claims
    assert fixed.replica_range is None
    (same,) = parse_manifests(ranged_yaml(2, 2)).claims
    assert same.replica_range is None and same.replicas == 2


@pytest.mark.parametrize(("low", "high", "says"), [
    (3, 2, "spec.maxReplicas (2) must be at least spec.replicas (3)"),
    (1, 9, "spec.maxReplicas must be a whole number from 1 to 8"),
    (1, '"2"', "spec.maxReplicas must be a whole number from 1 to 8"),
])
def test_a_range_that_is_not_one_is_refused_saying_what_to_fix(low: int, high: int | str,
                                                               says: str) -> None:
    result = parse_manifests(ranged_yaml(low, high))
    assert not result.claims
    (problem,) = result.problems
    assert problem.reason == "InvalidReplicas" and says in problem.message


def test_the_count_chosen_is_kept_within_the_range_across_new_versions() -> None:
    look = Lookups()
    (claim,) = parse_manifests(ranged_yaml(1, 3)).claims
    key = ("default", "c")
    look.claims[key] = look.scaled(key, claim)
    version = look.claims_version
    assert look.scale(key, 2) and look.claims[key].replicas == 2
    assert look.claims_version == version + 1
    assert not look.scale(key, 2)  # nothing changed
    assert look.claim(("default", "c#1")) is not None and look.claim(("default", "c#2")) is None
    assert look.scaled(key, claim).replicas == 2  # a new version read keeps the count
    (narrower,) = parse_manifests(ranged_yaml(1, 1)).claims
    assert look.scaled(key, narrower).replicas == 1  # no range now: spec.replicas
    (wider,) = parse_manifests(ranged_yaml(3, 4)).claims
    assert look.scaled(key, wider).replicas == 3  # brought into the new range
    (fixed,) = parse_manifests(claim_yaml("c")).claims
    look.claims[key] = fixed
    assert not look.scale(key, 2) and look.claims[key].replicas == 1
