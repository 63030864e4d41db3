"""Pre-staging: a pool whose policy asks for it has its agents stage the artifacts of claims that
wait to be placed; placement prefers the agents whose cache has them ready. Fake agents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reconciler.model.policy import parse_pool_policy
from tests.reconciler_fakes import FakeAgent, Rig, claim_yaml

pytestmark = pytest.mark.timeout(30)
PRESTAGE = "'" + json.dumps({"artifacts": {"preStage": True}}) + "'"
BIG = claim_yaml("big", footprint="30Gi")  # more than a 16 GiB card: waits to be placed


def test_the_policy_takes_pre_stage_and_refuses_what_it_does_not_know() -> None:
    policy, problem = parse_pool_policy({"artifacts": {"preStage": True}})
    assert problem is None and policy.pre_stage and not policy.idle_sleep
    both, problem = parse_pool_policy({"lifecycle": {"sleepAfterSeconds": 60},
                                       "artifacts": {"preStage": True}})
    assert problem is None and both.pre_stage and both.sleep_after_seconds == 60
    for bad in ({"artifacts": {"preStage": "yes"}}, {"artifacts": {"warm": True}},
                {"artifacts": []}):
        policy, problem = parse_pool_policy(bad)
        assert problem is not None and not policy.pre_stage


async def test_an_unplaced_claim_has_its_artifact_staged_once_on_each_agent_of_its_pool(
        tmp_path: Path) -> None:
    a, b = FakeAgent("agent-a"), FakeAgent("agent-b")
    rig = Rig(tmp_path, [a, b], BIG, policy=PRESTAGE)
    await rig.reconcile("big")
    assert rig.status("big").phase == "Pending"
    assert a.calls_of("download") == [("download", "huggingface://t/big")]
    assert b.calls_of("download") == [("download", "huggingface://t/big")]
    assert "PreStaging" in rig.events("big")
    await rig.reconcile("big", advance=30)  # the agents now show it downloading: not again
    assert len(a.calls_of("download")) == 1 and len(b.calls_of("download")) == 1
    b.staging.clear()
    b.cached.append("hf://t/big/")  # ready there: nothing to ask
    await rig.reconcile("big", advance=30)
    assert len(b.calls_of("download")) == 1


async def test_without_the_policy_nothing_is_staged(tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], BIG)
    await rig.reconcile("big")
    assert a.calls_of("download") == []


async def test_placement_prefers_the_agent_whose_cache_holds_the_artifact(
        tmp_path: Path) -> None:
    a, b = FakeAgent("agent-a"), FakeAgent("agent-b")
    b.cached.append("huggingface://t/m")
    rig = Rig(tmp_path, [a, b], claim_yaml("m"))
    await rig.reconcile("m")
    assert a.calls_of("activate") == [] and len(b.calls_of("activate")) == 1
