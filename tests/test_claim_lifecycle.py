"""A claim's own sleep policy (``claim.model.aibrix.ai/lifecycle``): the rule, and real agents
with simulated engines under a reconciler whose pool sleeps its models."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.model.changes import take_change
from reconciler.model.claim_lifecycle import (
    LIFECYCLE_ANNOTATION,
    ClaimLifecycle,
    lifecycle_of,
)
from reconciler.model.manifests import parse_manifests
from reconciler.model.policy import PoolPolicy, parse_pool_policy
from reconciler.planning.sleep_policy import victims
from reconciler.planning.state import Resident
from tests.harness import AgentProcess
from tests.test_reconciler_integration import CARD, Pool, sim_claim

GiB = 1 << 30


def annotated(text: str, lifecycle: str) -> str:
    """A claim manifest with the lifecycle annotation."""
    return text.replace("  namespace: default\n", "  namespace: default\n  annotations:\n"
                        f"    {LIFECYCLE_ANNOTATION}: '{lifecycle}'\n", 1)


# ---- the rule ----------------------------------------------------------------------------------


def test_a_claim_overrides_its_pools_idle_time_and_keeps_the_rest() -> None:
    pool, _ = parse_pool_policy('{"lifecycle": {"sleepAfterSeconds": 300, '
                                '"noWakeReserveWhileAsleep": true}}')
    own, problem = lifecycle_of({LIFECYCLE_ANNOTATION: '{"sleepAfterSeconds": 10}'})
    assert problem is None and own == ClaimLifecycle(10.0)
    applied = own.applied_to(pool)
    assert applied.sleep_after_seconds == 10.0
    assert applied.sleep_to_make_room_after_seconds == 10.0  # room no later than idle sleep
    assert applied.no_wake_reserve_while_asleep
    never, _ = lifecycle_of({LIFECYCLE_ANNOTATION: '{"neverSleep": true}'})
    assert never is not None and not never.applied_to(pool).idle_sleep
    assert never.make_room_after == math.inf
    assert lifecycle_of({}) == (None, None)
    assert lifecycle_of({LIFECYCLE_ANNOTATION: " "}) == (None, None)


@pytest.mark.parametrize(("text", "why"), [
    ('{"sleepAfterSeconds": 0}', 'must be positive, got 0; to keep the model awake write '
                                 '{"neverSleep": true}'),
    ('{"neverSleep": true, "sleepAfterSeconds": 5}', "cannot be given with"),
    ('{"sleepAfterSeconds": 5, "sleepToMakeRoomAfterSeconds": 9}', "must be no longer than"),
    ('{"sleepAfter": 5}', "unknown field sleepAfter; known: neverSleep, sleepAfterSeconds, "
                          "sleepToMakeRoomAfterSeconds"),
    ('{"neverSleep": "yes"}', "neverSleep must be true or false"),
    ('{"sleepAfterSeconds": NaN}', "NaN is not a valid JSON number"),
    ("[1]", "must be a JSON object"),
    ("{", "not valid JSON"),
])
def test_an_invalid_lifecycle_says_what_to_fix_and_leaves_the_pools_policy(text: str,
                                                                          why: str) -> None:
    own, problem = lifecycle_of({LIFECYCLE_ANNOTATION: text})
    assert own is None and problem is not None
    assert problem.startswith(f"{LIFECYCLE_ANNOTATION} ignored, the pool's policy applies: ")
    assert why in problem


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=10)


@given(st.one_of(st.text(), JSON.map(json.dumps), st.dictionaries(
    st.sampled_from(("sleepAfterSeconds", "sleepToMakeRoomAfterSeconds", "neverSleep")),
    JSON).map(json.dumps), JSON))
def test_any_annotation_gives_a_lifecycle_or_a_reason_never_an_exception(raw: object) -> None:
    own, problem = lifecycle_of({LIFECYCLE_ANNOTATION: raw})
    assert (own is None) or problem is None
    if own is not None:
        applied = own.applied_to(PoolPolicy(sleep_after_seconds=60.0))
        assert applied.sleep_after_seconds >= 0
        assert applied.sleep_to_make_room_after_seconds > 0


def test_the_annotation_is_read_from_a_claim_manifest() -> None:
    parsed = parse_manifests(annotated(sim_claim("m"), '{"neverSleep": true}'))
    (claim,) = parsed.claims
    assert claim.lifecycle == ClaimLifecycle(never_sleep=True) and not claim.problems
    (bad,) = parse_manifests(annotated(sim_claim("m"), '{"neverSleep": 1}')).claims
    assert bad.lifecycle is None and "neverSleep must be true or false" in str(
        bad.lifecycle_problem)
    assert bad.hold_reason is None  # the claim still runs, under its pool's policy


def test_a_claim_that_never_sleeps_is_never_a_victim_for_room() -> None:
    policy = PoolPolicy(no_wake_reserve_while_asleep=True, sleep_to_make_room_after_seconds=1.0)
    kept = Resident("kept", 4 * GiB, GiB, last_busy=0.0, make_room_after=math.inf)
    other = Resident("other", 4 * GiB, GiB, last_busy=50.0)
    assert victims(11 * GiB, 5 * GiB, [kept, other], policy, now=100.0) == ["other"]
    assert victims(11 * GiB, 10 * GiB, [kept, other], policy, now=100.0) is None
    patient = Resident("patient", 4 * GiB, GiB, last_busy=0.0, make_room_after=200.0)
    assert victims(11 * GiB, 5 * GiB, [patient, other], policy, now=100.0) == ["other"]


# ---- real agents -------------------------------------------------------------------------------


@pytest.fixture
async def pool(tmp_path: Path,
               agent_factory: Callable[..., AgentProcess]) -> AsyncIterator[Pool]:
    made = Pool(tmp_path, [agent_factory(restart_delays="0.05", extra_args=CARD)
                           for _ in range(2)])
    yield made
    if made.app is not None:
        await made.app.stop()


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_claim_that_never_sleeps_stays_awake_while_its_neighbours_sleep(
        pool: Pool) -> None:
    pool.write_pool('{"lifecycle": {"sleepAfterSeconds": 5}}')
    pool.write("plain", sim_claim("plain"))
    pool.write("keep", annotated(sim_claim("keep"), '{"neverSleep": true}'))
    pool.write("quick", annotated(sim_claim("quick"), '{"sleepAfterSeconds": 1}'))
    pool.write("typo", annotated(sim_claim("typo"), '{"neverSleep": "true"}'))
    await pool.start()
    for name in ("plain", "keep", "quick", "typo"):
        await pool.phase(name, "Active", timeout=30)
    quick = await pool.phase("quick", "Sleeping", timeout=10)
    (slept,) = [e.message for e in quick.events if e.reason == "Sleeping"]
    assert int(re.match(r"idle for (\d+) s", slept).group(1)) < 5  # type: ignore[union-attr]
    for name in ("plain", "typo"):  # the pool's 5 s: the invalid annotation is ignored
        await pool.phase(name, "Sleeping", timeout=20)
    keep = pool.status("keep")
    assert keep is not None and keep.phase == "Active"
    assert (keep.conditions["LifecycleApplied"].status,
            keep.conditions["LifecycleApplied"].reason) == ("True", "Applied")
    typo = pool.status("typo")
    assert typo is not None
    cond = typo.conditions["LifecycleApplied"]
    assert (cond.status, cond.reason) == ("False", "InvalidLifecycle")
    assert "neverSleep must be true or false" in cond.message
    assert "InvalidLifecycle" in [e.reason for e in typo.events if e.type == "Warning"]
    assert "LifecycleApplied" not in pool.status("plain").conditions  # type: ignore[union-attr]
    await asyncio.sleep(2.0)  # past every idle time the pool and the claims name
    keep = pool.status("keep")
    assert keep is not None and keep.phase == "Active"
    engine = pool.engine(keep.instance.agent, "keep-model")  # type: ignore[union-attr]
    assert engine is not None and engine["phase"] == "active"


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_room_is_made_by_sleeping_a_claim_that_may_sleep_not_one_that_never_does(
        tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory(extra_args=["--simulate-gpus", "1x8GiB", "--gpu-reserve", "1GiB"])
    pool = Pool(tmp_path, [agent])
    pool.write_pool('{"lifecycle": {"noWakeReserveWhileAsleep": true, '
                    '"sleepToMakeRoomAfterSeconds": 1}}')
    small = {"footprint": "2Gi", "kv_floor": "1Gi"}
    try:
        pool.write("first", annotated(sim_claim("first", **small), '{"neverSleep": true}'))
        await pool.start()
        await pool.phase("first", "Active")
        pool.write("second", sim_claim("second", **small))
        await pool.phase("second", "Active")
        await asyncio.sleep(1.2)  # both idle past sleepToMakeRoomAfterSeconds, first longer
        pool.write("third", sim_claim("third", **small))  # 7 GiB usable: no room for a third
        await pool.phase("third", "Active")
        second = await pool.phase("second", "Sleeping")
        assert "SleptToMakeRoom" in [e.reason for e in second.events]
        first = pool.status("first")
        assert first is not None and first.phase == "Active"
        assert "SleptToMakeRoom" not in [e.reason for e in first.events]
    finally:
        if pool.app is not None:
            await pool.app.stop()


def test_a_claims_labels_say_what_its_model_is_and_may_change_while_it_runs() -> None:
    text = sim_claim("m").replace("  namespace: default\n", "  namespace: default\n  labels: "
                                  '{family: qwen3, "capability/code": "true"}\n', 1)
    (claim,) = parse_manifests(text).claims
    assert dict(claim.labels) == {"family": "qwen3", "capability/code": "true"}
    edited = parse_manifests(text.replace("qwen3", "qwen3.5").replace(
        "huggingface://t/m-model", "huggingface://t/other")).claims[0]
    taken = take_change(claim, edited)
    assert taken.problem is not None  # the artifact may not change...
    assert dict(taken.claim.labels)["family"] == "qwen3.5"  # ...the labels may
