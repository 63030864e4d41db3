"""Sleep policy: idle models go to sleep; idle models make room, longest idle first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from contract.quantity import GiB, MiB
from reconciler.model.policy import PoolPolicy
from reconciler.model.selector import LabelSelector
from reconciler.planning.placement import ClaimNeed, Unplaced, place
from reconciler.planning.sleep_policy import (
    DEFAULT_UNKNOWN_SLEEPING_FOOTPRINT,
    MakeRoom,
    expected_freed,
    idle_to_sleep,
    make_room,
    victims,
)
from reconciler.planning.state import Candidate, EngineState, Gpu, Resident, charge

NOW = 10_000.0
SLEEP_60 = PoolPolicy(60)
NO_RESERVE = PoolPolicy(300, True, 30)
AWAKE_UNLESS_NEEDED = PoolPolicy(0, True, 30)
LABELS = {"claim.model.aibrix.ai/pool": "pool-a", "claim.model.aibrix.ai/enabled": "true"}
SELECTOR = LabelSelector({"claim.model.aibrix.ai/pool": "pool-a"})


def engine(name: str, idle: float | None = None, footprint: float = 6, kv_floor: float = 1,
           **kw: object) -> Resident:
    """An engine idle for ``idle`` seconds (None: last-busy time unknown)."""
    last_busy = None if idle is None else NOW - idle
    return Resident(name, int(footprint * GiB), int(kv_floor * GiB), last_busy=last_busy,
                    **kw)  # type: ignore[arg-type]


# ---- idle sleep -----------------------------------------------------------------------------


def test_a_model_idle_for_sleep_after_seconds_is_put_to_sleep_longest_idle_first() -> None:
    engines = [engine("a", 61), engine("b", 600), engine("c", 59), engine("d", 60)]
    assert idle_to_sleep(engines, SLEEP_60, NOW) == ["b", "a", "d"]


def test_a_model_with_a_request_running_or_waiting_is_not_idle() -> None:
    engines = [engine("r", 600, running=1), engine("w", 600, waiting=2),
               engine("u", 600, running=None), engine("t", None)]
    assert idle_to_sleep(engines, SLEEP_60, NOW) == []


def test_only_awake_engines_that_can_sleep_are_put_to_sleep() -> None:
    engines = [engine("s", 600, state=EngineState.ASLEEP),
               engine("b", 600, state=EngineState.STARTING),
               engine("o", 600, can_sleep=False), engine("v", 600)]
    assert idle_to_sleep(engines, SLEEP_60, NOW) == ["v"]


def test_a_pool_without_sleep_after_seconds_keeps_idle_models_awake() -> None:
    assert idle_to_sleep([engine("a", 10**6)], AWAKE_UNLESS_NEEDED, NOW) == []
    assert idle_to_sleep([engine("a", 10**6)], PoolPolicy(), NOW) == []


# ---- victims --------------------------------------------------------------------------------


def test_a_waking_model_fits_by_putting_the_longest_idle_model_to_sleep() -> None:
    waking = engine("w", state=EngineState.ASLEEP, sleeping_footprint=GiB)
    engines = [engine("a", 100), engine("b", 400), waking]
    # 16 GiB: a and b hold 7 each, w its 1 GiB; w needs 7, and 2 are free once w is set aside.
    assert victims(16 * GiB, 7 * GiB, engines, NO_RESERVE, NOW, waking="w") == ["b"]


def test_a_model_that_fits_wakes_at_once() -> None:
    engines = [engine("a", 100), engine("w", state=EngineState.ASLEEP, sleeping_footprint=GiB)]
    assert victims(16 * GiB, 7 * GiB, engines, NO_RESERVE, NOW, waking="w") == []


def test_models_busy_lately_are_not_put_to_sleep_to_make_room() -> None:
    engines = [engine("a", 29), engine("b", 400, running=1), engine("c", 400, waiting=1),
               engine("w", state=EngineState.ASLEEP, sleeping_footprint=GiB)]
    assert victims(22 * GiB, 7 * GiB, engines, NO_RESERVE, NOW, waking="w") is None
    assert victims(22 * GiB, 7 * GiB, engines, PoolPolicy(300, True, 20), NOW,
                   waking="w") == ["a"]


def test_several_models_sleep_one_after_another_when_one_is_not_enough() -> None:
    engines = [engine("a", 100, 3, 1), engine("b", 200, 3, 1), engine("c", 300, 3, 1)]
    # 12 GiB, all full; a newcomer needs 7: each sleeper frees 4 - 1 = 3 GiB.
    assert victims(12 * GiB, 7 * GiB, engines, NO_RESERVE, NOW) == ["c", "b", "a"]
    measured = [engine("a", 100, 3, 1), engine("b", 200, 3, 1, sleeping_footprint=0),
                engine("c", 300, 3, 1, sleeping_footprint=0)]
    assert victims(12 * GiB, 7 * GiB, measured, NO_RESERVE, NOW) == ["c", "b"]


def test_sleeping_others_cannot_help_when_sleeping_models_keep_their_room() -> None:
    engines = [engine("a", 1000), engine("b", 1000)]
    assert victims(16 * GiB, 7 * GiB, engines, PoolPolicy(60), NOW) is None


def test_a_sleeping_model_whose_footprint_is_unknown_keeps_its_full_room() -> None:
    unknown = engine("s", state=EngineState.ASLEEP)
    measured = engine("s", state=EngineState.ASLEEP, sleeping_footprint=GiB)
    assert charge(unknown, NO_RESERVE) == 7 * GiB and charge(measured, NO_RESERVE) == GiB
    assert victims(14 * GiB, 7 * GiB, [unknown], NO_RESERVE, NOW) == []
    assert victims(8 * GiB, 7 * GiB, [measured], NO_RESERVE, NOW) == []
    assert victims(8 * GiB, 7 * GiB, [unknown], NO_RESERVE, NOW) is None


# ---- making room for a new claim ------------------------------------------------------------


def test_a_new_claim_gets_room_where_the_fewest_idle_models_must_sleep() -> None:
    need = ClaimNeed("default/new", SELECTOR, 6 * GiB, GiB)
    one = Candidate("one", (Gpu(0, 16 * GiB, (engine("a", 500), engine("b", 500))),), LABELS,
                    policy=NO_RESERVE)
    two = Candidate("two", (Gpu(0, 12 * GiB, (engine("c", 500, 3, 1), engine("d", 500, 3, 1),
                                              engine("e", 500, 3, 1))),), LABELS,
                    policy=NO_RESERVE)
    kept = Candidate("kept", (Gpu(0, 16 * GiB, (engine("f", 500), engine("g", 500))),), LABELS,
                     policy=SLEEP_60)
    assert isinstance(place(need, [one, two, kept], NOW), Unplaced)
    assert make_room(need, [two, one, kept], NOW) == MakeRoom("one", (0,), ("a",))
    assert make_room(need, [kept], NOW) is None


# ---- properties -----------------------------------------------------------------------------

_engines = st.lists(st.builds(
    Resident,
    name=st.sampled_from(["e0", "e1", "e2", "e3", "e4", "e5"]),
    footprint=st.integers(1, 8 * 1024).map(lambda m: m * MiB),
    kv_floor=st.integers(1, 2 * 1024).map(lambda m: m * MiB),
    state=st.sampled_from(list(EngineState)),
    running=st.none() | st.sampled_from([0.0, 0.0, 1.0]),
    waiting=st.sampled_from([0.0, 0.0, 2.0]),
    last_busy=st.none() | st.floats(NOW - 1000, NOW),
    kv_used=st.none() | st.integers(0, 4 * GiB),
    sleeping_footprint=st.none() | st.integers(0, 2 * GiB),
    can_sleep=st.booleans(),
), max_size=6, unique_by=lambda e: e.name)
_policies = st.sampled_from([NO_RESERVE, AWAKE_UNLESS_NEEDED, PoolPolicy(300, True, 120),
                             PoolPolicy(60)])


def admissible(e: Resident, policy: PoolPolicy, waking: str | None) -> bool:
    idle = e.idle_for(NOW)
    return (e.name != waking and e.state is EngineState.AWAKE and e.can_sleep
            and idle is not None and idle >= policy.sleep_to_make_room_after_seconds
            and policy.no_wake_reserve_while_asleep)


@settings(max_examples=500)
@given(_engines, _policies, st.integers(1, 48).map(lambda g: g * GiB),
       st.integers(1, 16 * 1024).map(lambda m: m * MiB), st.booleans())
def test_victims_are_idle_long_enough_longest_idle_first_and_found_whenever_any_set_works(
        engines: list[Resident], policy: PoolPolicy, usable: int, need: int,
        wake_first: bool) -> None:
    waking = engines[0].name if engines and wake_first else None
    room = usable - sum(charge(e, policy) for e in engines if e.name != waking)
    got = victims(usable, need, engines, policy, NOW, waking=waking)
    pool = sorted((e for e in engines if admissible(e, policy, waking)),
                  key=lambda e: (-(e.idle_for(NOW) or 0), e.name))
    useful = [e for e in pool if expected_freed(e, policy) > 0]
    everything = room + sum(expected_freed(e, policy) for e in useful)
    if room >= need:
        assert got == []
    elif everything < need:
        assert got is None
    else:
        assert got is not None and got != []
        by_name = {e.name: e for e in engines}
        chosen = [by_name[n] for n in got]
        assert all(admissible(e, policy, waking) for e in chosen)
        assert chosen == useful[:len(chosen)]  # longest idle first, none skipped
        freed = [expected_freed(e, policy) for e in chosen]
        assert room + sum(freed) >= need > room + sum(freed[:-1])  # and no more than needed


@settings(max_examples=300)
@given(_engines, _policies)
def test_idle_sleep_takes_exactly_the_awake_engines_idle_for_sleep_after_seconds(
        engines: list[Resident], policy: PoolPolicy) -> None:
    got = idle_to_sleep(engines, policy, NOW)
    expected = [e for e in engines if policy.idle_sleep and e.state is EngineState.AWAKE
                and e.can_sleep and e.idle_for(NOW) is not None
                and (e.idle_for(NOW) or 0) >= policy.sleep_after_seconds]
    assert sorted(got) == sorted(e.name for e in expected)
    idles = [next(e for e in engines if e.name == n).idle_for(NOW) or 0 for n in got]
    assert idles == sorted(idles, reverse=True)


@settings(max_examples=200)
@given(_engines, st.integers(1, 48).map(lambda g: g * GiB),
       st.integers(1, 8).map(lambda g: g * GiB))
def test_room_made_for_a_new_claim_is_room_on_that_agent(
        engines: list[Resident], usable: int, fp: int) -> None:
    need = ClaimNeed("c", SELECTOR, fp, GiB)
    pod = Candidate("p", (Gpu(0, usable, tuple(engines)),), LABELS, policy=NO_RESERVE)
    plan = make_room(need, [pod], NOW)
    if plan is None:
        assert victims(usable, fp + GiB, engines, NO_RESERVE, NOW) is None
        return
    slept = tuple(
        Resident(e.name, e.footprint, e.kv_floor, EngineState.ASLEEP,
                 sleeping_footprint=e.sleeping_footprint
                 if e.sleeping_footprint is not None else DEFAULT_UNKNOWN_SLEEPING_FOOTPRINT)
        if e.name in plan.victims else e for e in engines)
    assert Gpu(0, usable, slept).room(NO_RESERVE) >= fp + GiB
