"""Victims by need and the reservation book: the least needed idle models go first, and a plan
is claimed before anything is released, then released by its end or its timeout."""

from __future__ import annotations

import pytest

from reconciler.selection.delay import Demand
from reconciler.selection.reservations import Book, Plan
from reconciler.selection.victims import Occupant, choose_victims

pytestmark = pytest.mark.timeout(30)
NOW = 1_000.0


def idle(name: str, frees: int, **demand: float) -> Occupant:
    """An occupant idle for 100 s (past the 30 s used here) with the given demand."""
    return Occupant(name, frees, idle_since=NOW - 100.0,
                    demand=Demand(**demand))  # type: ignore[arg-type]


def names(got: tuple[Occupant, ...] | None) -> list[str] | None:
    return None if got is None else [o.name for o in got]


def test_among_equally_few_the_least_needed_goes_first() -> None:
    pool = [idle("intended", 4, intents=1), idle("used", 4, recent_use=2.0),
            idle("recent", 4, last_used=NOW - 1), idle("stale", 4, last_used=NOW - 50)]
    assert names(choose_victims(pool, 4, NOW, 30.0)) == ["stale"]
    assert names(choose_victims(pool, 8, NOW, 30.0)) == ["stale", "recent"]
    assert names(choose_victims(pool, 12, NOW, 30.0)) == ["stale", "recent", "used"]


def test_the_fewest_victims_win_over_less_needed_ones() -> None:
    pool = [idle("small-a", 2), idle("small-b", 2), idle("big", 4, recent_use=3.0)]
    assert names(choose_victims(pool, 4, NOW, 30.0)) == ["big"]


def test_busy_waited_for_recently_idle_and_planned_models_are_never_victims() -> None:
    pool = [Occupant("busy", 8, in_flight=1, idle_since=NOW - 100.0),
            idle("awaited", 8, waiters=1),
            Occupant("just-idle", 8, idle_since=NOW - 10.0),
            Occupant("unknown", 8, idle_since=None), idle("planned", 8)]
    assert choose_victims(pool, 1, NOW, 30.0, planned={"planned"}) is None
    assert choose_victims(pool, 0, NOW, 30.0) == ()


def test_a_plan_is_released_by_its_end_or_by_its_timeout_never_kept() -> None:
    book = Book()
    a = Plan("a", "g", "m", 4, NOW + 10, {"v": 4})
    b = Plan("b", "g", "n", 2, NOW + 100)
    book = book.claim(a, 2, {"v"}) or book
    book = book.claim(b, 2, {"v"}) or book
    assert [p.id for p in book.plans] == ["a", "b"] and book.intents("m") == 1
    assert [p.id for p in book.live(NOW + 10).plans] == ["b"]
    assert [p.id for p in book.release("b").plans] == ["a"]


def test_a_plan_whose_victim_took_a_request_meanwhile_is_refused() -> None:
    plan = Plan("a", "g", "m", 4, NOW + 10, {"v": 4})
    assert Book().claim(plan, 0, {"v"}, busy={"v"}) is None
    assert Book().claim(plan, 0, set()) is None  # the victim is gone: no credit
    assert Book().claim(plan, 0, {"v"}) is not None
