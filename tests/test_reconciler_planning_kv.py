"""KV division on one GPU: floors kept, the rest to the busy, never over-committed, stable."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from contract.quantity import GiB, MiB
from reconciler.model.policy import PoolPolicy
from reconciler.planning.kv_division import (
    HYSTERESIS,
    QUANTUM,
    LimitChange,
    committed,
    divide,
    divide_gpus,
    load_band,
    order_changes,
)
from reconciler.planning.state import EngineState, Gpu, Resident, charge

DEFAULT = PoolPolicy(300)
NO_RESERVE = PoolPolicy(300, True, 30)


def engine(name: str, footprint: float = 6, kv_floor: float = 1, load: float = 0,
           **kw: object) -> Resident:
    return Resident(name, int(footprint * GiB), int(kv_floor * GiB), running=load,
                    **kw)  # type: ignore[arg-type]


def test_the_guides_two_idle_models_split_the_rest_of_a_16_gib_card_evenly() -> None:
    limits = divide(16 * GiB, [engine("a"), engine("b")], DEFAULT)
    assert limits == {"a": 2 * GiB, "b": 2 * GiB}


def test_the_busy_engine_gets_more_of_the_rest() -> None:
    limits = divide(16 * GiB, [engine("a", load=4), engine("b")], DEFAULT)
    # spare 2 GiB; weights 1 + 4 and 1 + 0.
    assert limits["a"] == GiB + (2 * GiB * 5 // 6) // QUANTUM * QUANTUM
    assert limits["b"] == GiB + (2 * GiB // 6) // QUANTUM * QUANTUM
    assert limits["a"] > limits["b"]


def test_kv_in_use_above_the_floor_is_kept_and_only_the_rest_is_shared() -> None:
    # b holds 1.5 GiB of live KV (idle now): a limit below that would free nothing yet, and
    # a's grow into it would over-commit the card.
    limits = divide(16 * GiB, [engine("a"), engine("b", kv_used=int(1.5 * GiB))], DEFAULT)
    assert limits["b"] >= int(1.5 * GiB)
    assert limits["a"] == GiB + (3 * GiB // 2) // 2 // QUANTUM * QUANTUM  # half of 1.5 GiB spare
    assert limits["b"] == int(1.5 * GiB) + limits["a"] - GiB
    assert 12 * GiB + sum(limits.values()) <= 16 * GiB


def test_load_counts_by_power_of_two_bands() -> None:
    assert [load_band(x) for x in (None, 0, 0.5, 1, 2, 3, 4, 7, 8, 15.9, 16)] == [
        0, 0, 0, 1, 2, 2, 4, 4, 8, 8, 16]


def test_a_sleeping_engine_keeps_its_floor_by_default() -> None:
    limits = divide(16 * GiB, [engine("a"), engine("s", state=EngineState.ASLEEP,
                                                   sleeping_footprint=GiB)], DEFAULT)
    # 16 - (6 + 1) for the sleeper's room - 6 for a's footprint: a gets the other 3 GiB.
    assert limits == {"a": 3 * GiB, "s": GiB}


def test_without_a_wake_reserve_a_sleeping_engine_holds_only_its_sleeping_footprint() -> None:
    asleep = engine("s", state=EngineState.ASLEEP, sleeping_footprint=GiB)
    limits = divide(16 * GiB, [engine("a"), asleep], NO_RESERVE)
    assert limits == {"a": 16 * GiB - GiB - 6 * GiB}
    unknown = engine("s", state=EngineState.ASLEEP)
    assert divide(16 * GiB, [engine("a"), unknown], NO_RESERVE) == {"a": 3 * GiB, "s": GiB}


def test_a_starting_engine_gets_its_share_like_an_awake_one() -> None:
    limits = divide(16 * GiB, [engine("a"), engine("b", state=EngineState.STARTING)], DEFAULT)
    assert limits == {"a": 2 * GiB, "b": 2 * GiB}


def test_an_over_committed_card_gives_the_awake_engines_their_floors() -> None:
    assert divide(12 * GiB, [engine("a"), engine("b")], DEFAULT) == {"a": GiB, "b": GiB}


def test_an_engine_on_two_gpus_gets_the_lesser_of_its_shares() -> None:
    tp = engine("tp", 4, 1)
    gpus = [Gpu(0, 16 * GiB, (tp,)), Gpu(1, 16 * GiB, (tp, engine("b", 4, 1)), other=GiB)]
    limits = divide_gpus(gpus, DEFAULT)
    assert limits["tp"] == GiB + (16 * GiB - GiB - 10 * GiB) // 2
    for gpu in gpus:
        assert committed(gpu.engines, limits, DEFAULT) <= gpu.usable - gpu.other


def test_current_limits_within_the_hysteresis_band_are_kept() -> None:
    first = divide(16 * GiB, [engine("a"), engine("b")], DEFAULT)
    nudged = {"a": first["a"] + 128 * MiB, "b": first["b"] - 128 * MiB}
    engines = [engine("a", load=4, kv_limit=nudged["a"]), engine("b", kv_limit=nudged["b"])]
    # Four requests in flight move a's share by about 600 MiB: past the band, so it moves.
    assert divide(16 * GiB, engines, DEFAULT) != nudged
    calm = [engine("a", kv_limit=nudged["a"]), engine("b", kv_limit=nudged["b"])]
    assert divide(16 * GiB, calm, DEFAULT) == nudged


def test_limits_change_in_an_order_that_never_over_commits() -> None:
    shrinks, grows = order_changes({"a": 4 * GiB, "b": GiB, "c": None, "gone": GiB},
                                   {"a": 2 * GiB, "b": 3 * GiB, "c": GiB, "d": 2 * GiB})
    # Unknown current limits (c, and d, not seen yet) start at full capacity: they come first.
    assert shrinks == [LimitChange("c", None, GiB), LimitChange("d", None, 2 * GiB),
                       LimitChange("a", 4 * GiB, 2 * GiB)]
    assert grows == [LimitChange("b", GiB, 3 * GiB)]
    assert order_changes({"a": GiB}, {"a": GiB}) == ([], [])


# ---- properties -----------------------------------------------------------------------------

NAMES = ["e0", "e1", "e2", "e3", "e4"]


@st.composite
def gpus(draw: st.DrawFn, policy: PoolPolicy | None = None) -> tuple[int, list[Resident],
                                                                     PoolPolicy]:
    """A feasible GPU: footprints, floors and sleeping charges fit in ``usable``."""
    pol = policy or draw(st.sampled_from([DEFAULT, NO_RESERVE]))
    engines = []
    for name in draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=5)):
        state = draw(st.sampled_from(list(EngineState)))
        engines.append(Resident(
            name, draw(st.integers(1, 8 * GiB)), draw(st.integers(1, 2 * GiB)), state,
            running=draw(st.none() | st.floats(0, 100)), waiting=draw(st.floats(0, 100)),
            sleeping_footprint=draw(st.none() | st.integers(0, GiB)),
            kv_limit=draw(st.none() | st.integers(0, 8 * GiB))))
    need = sum(charge(e, pol) if e.asleep else e.room for e in engines)
    usable = need + draw(st.integers(0, 40 * GiB))
    return usable, engines, pol


@settings(max_examples=400)
@given(gpus())
def test_the_division_never_over_commits_and_every_awake_engine_keeps_its_floor(
        case: tuple[int, list[Resident], PoolPolicy]) -> None:
    usable, engines, policy = case
    limits = divide(usable, engines, policy)
    assert committed(engines, limits, policy) <= usable
    for e in engines:
        if not e.asleep:
            assert limits[e.name] >= e.kv_floor
        elif policy.no_wake_reserve_while_asleep and e.sleeping_footprint is not None:
            assert e.name not in limits
        else:
            assert limits[e.name] == e.kv_floor


@settings(max_examples=200)
@given(gpus(), st.randoms(use_true_random=False))
def test_the_same_input_gives_the_same_limits_in_any_order(
        case: tuple[int, list[Resident], PoolPolicy], rnd: random.Random) -> None:
    usable, engines, policy = case
    shuffled = list(engines)
    rnd.shuffle(shuffled)
    assert divide(usable, engines, policy) == divide(usable, shuffled, policy)


@settings(max_examples=200)
@given(gpus(), st.data())
def test_load_jitter_inside_a_band_changes_no_limit(
        case: tuple[int, list[Resident], PoolPolicy], data: st.DataObject) -> None:
    usable, engines, policy = case
    fresh = [Resident(e.name, e.footprint, e.kv_floor, e.state, e.running, e.waiting,
                      sleeping_footprint=e.sleeping_footprint) for e in engines]
    jittered = []
    for e in fresh:
        band = load_band(e.load)
        top = 0.99 if band == 0 else 2 * band - 0.01
        load = data.draw(st.floats(band, top))
        jittered.append(Resident(e.name, e.footprint, e.kv_floor, e.state, load, 0.0,
                                 sleeping_footprint=e.sleeping_footprint))
    assert divide(usable, fresh, policy) == divide(usable, jittered, policy)


@settings(max_examples=200)
@given(gpus(), st.data())
def test_limits_already_applied_stay_put_while_load_is_stable_and_move_only_past_the_band(
        case: tuple[int, list[Resident], PoolPolicy], data: st.DataObject) -> None:
    usable, engines, policy = case
    plain = [Resident(e.name, e.footprint, e.kv_floor, e.state, e.running, e.waiting,
                      sleeping_footprint=e.sleeping_footprint) for e in engines]
    applied = divide(usable, plain, policy)
    settled = [Resident(e.name, e.footprint, e.kv_floor, e.state, e.running, e.waiting,
                        kv_limit=applied.get(e.name), sleeping_footprint=e.sleeping_footprint)
               for e in engines]
    assert divide(usable, settled, policy) == applied
    # New loads: either every engine stays within the band and nothing moves, or the fresh plan.
    moved = [Resident(e.name, e.footprint, e.kv_floor, e.state,
                      data.draw(st.floats(0, 100)), 0.0, kv_limit=e.kv_limit,
                      sleeping_footprint=e.sleeping_footprint) for e in settled]
    plan = divide(usable, [Resident(e.name, e.footprint, e.kv_floor, e.state, e.running, 0.0,
                                    sleeping_footprint=e.sleeping_footprint) for e in moved],
                  policy)
    got = divide(usable, moved, policy)
    near = all(abs(plan[e.name] - applied[e.name]) < HYSTERESIS for e in moved if not e.asleep)
    assert got == (applied if near else plan)
    assert committed(moved, got, policy) <= usable


@settings(max_examples=200)
@given(gpus(policy=DEFAULT))
def test_a_busier_engine_never_gets_less_than_an_idler_one_with_the_same_floor(
        case: tuple[int, list[Resident], PoolPolicy]) -> None:
    usable, engines, policy = case
    engines = [Resident(e.name, e.footprint, GiB, e.state, e.running, e.waiting)
               for e in engines]
    usable = max(usable, sum(e.footprint + GiB for e in engines))
    limits = divide(usable, engines, policy)
    awake = [e for e in engines if not e.asleep]
    for a in awake:
        for b in awake:
            if load_band(a.load) > load_band(b.load):
                assert limits[a.name] >= limits[b.name]
    # All of the spare memory is handed out but for rounding (under a quantum per engine).
    if awake:
        assert usable - committed(engines, limits, policy) < len(awake) * QUANTUM


_limits = st.dictionaries(st.sampled_from(NAMES), st.integers(1, 16 * GiB), max_size=5)


@settings(max_examples=300)
@given(_limits, _limits, st.integers(0, 64 * GiB))
def test_shrinks_then_grows_keep_every_intermediate_sum_within_the_card(
        current: dict[str, int], planned: dict[str, int], slack: int) -> None:
    current = {**{k: v + 1 for k, v in planned.items()}, **current}  # every current limit known
    target = {**current, **planned}
    card = max(sum(current.values()), sum(target.values())) + slack
    state = dict(current)
    shrinks, grows = order_changes(current, planned)
    sums = [sum(state.values())]
    for change in shrinks + grows:
        assert change.old == current[change.engine]
        state[change.engine] = change.new
        sums.append(sum(state.values()))
    assert state == target
    assert all(s <= card for s in sums)
    during_shrinks = sums[:len(shrinks) + 1]
    assert all(a > b for a, b in zip(during_shrinks, during_shrinks[1:], strict=False))
    assert all(s <= sum(target.values()) for s in sums[len(shrinks):])
    assert all(c.new > (c.old or 0) for c in grows)
