"""The KV figures tell the truth to AIBrix's controller and to people, with real processes.

Two drifts seen on ``main`` (issue 22): a limit above the engine's startup capacity was never
reported in force, so AIBrix's pool policy (it skips a model when its target equals
``kv_capacity_bytes``) sent it again under a new operation id on every tick, and the first such
call answered ``applied: true`` although nothing changed; and a segment deleted under a running
engine left ``kv_limit_applied_bytes`` at its old value. Each test runs a real agent with
simulated engines; the simulator recreates a deleted segment as kvcached's write path does
(zero-filled, on its next update of ``used_size``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from runtime_agent.kv.segment import read_segment
from tests.harness import AgentProcess, complete, http_json
from tests.waits import until_blocking

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
GiB, MiB = 2**30, 2**20
CAPACITY = 2 * GiB  # the simulated engine's KV cache at start-up


def _segment_seen(agent: AgentProcess, name: str) -> dict[str, Any]:
    return agent.model(agent.wait_for(
        lambda s: agent.model(s, name)["kv_segment"]["present"]
        and agent.model(s, name)["kv_startup_capacity_bytes"] == CAPACITY,
        what=f"{name}'s segment"), name)


def _pool_policy_ticks(agent: AgentProcess, name: str, target: int, ticks: int) -> list[dict]:
    """What AIBrix's pool policy does each tick (``pool_policy_controller.go``): read the
    snapshot, skip the model when ``target == kv_capacity_bytes``, else send the target under
    an operation id made of the tick. The answers of the calls it made."""
    answers = []
    for tick in range(ticks):
        if agent.model(agent.client.snapshot(), name)["kv_capacity_bytes"] == target:
            continue
        answers.append(agent.client.kv_limit(name, target, operation_id=f"pool-policy-kv/{tick}"))
    return answers


def test_a_limit_above_the_startup_capacity_is_in_force_and_sent_only_once(
        agent: AgentProcess) -> None:
    agent.activate_sim("m1")
    _segment_seen(agent, "m1")
    answers = _pool_policy_ticks(agent, "m1", 8 * GiB, ticks=4)
    assert len(answers) == 1, answers  # then the controller's skip test holds
    first = answers[0]
    # The segment held all 2 GiB already: nothing changed, and the limit is in force.
    assert first["status"] == "success" and first["applied"] is False and first["in_force"]
    assert first["clamped"] is True and first["applied_bytes"] == CAPACITY
    m1 = agent.model(agent.client.snapshot(), "m1")
    assert m1["kv_capacity_bytes"] == 8 * GiB  # what the controller compares with its target
    assert (m1["kv_limit_requested_bytes"], m1["kv_limit_applied_bytes"]) == (8 * GiB, CAPACITY)
    assert m1["kv_limit_capped_by"] == "engine_kv_capacity"  # and the truth stays visible
    assert (m1["kv_startup_capacity_bytes"], m1["kv_total_bytes"]) == (CAPACITY, CAPACITY)
    assert read_segment("kvc_m1", agent.shm_dir).total_size == CAPACITY  # never written above


def test_applied_says_whether_a_kv_limit_call_changed_the_segment(agent: AgentProcess) -> None:
    agent.activate_sim("m1")
    _segment_seen(agent, "m1")
    lowered = agent.client.kv_limit("m1", GiB, operation_id="a")
    assert lowered["applied"] is True and lowered["in_force"] is True
    again = agent.client.kv_limit("m1", GiB, operation_id="b")  # a new id, the same limit
    assert again["status"] == "success" and again["applied"] is False and again["in_force"]
    above = agent.client.kv_limit("m1", 8 * GiB, operation_id="c")  # 1 GiB -> all 2 GiB
    assert above["applied"] is True and above["in_force"] is True
    assert agent.model(agent.client.snapshot(), "m1")["kv_capacity_bytes"] == 8 * GiB
    higher = agent.client.kv_limit("m1", 16 * GiB, operation_id="d")  # still all of it
    assert higher["applied"] is False and higher["in_force"] is True
    assert agent.model(agent.client.snapshot(), "m1")["kv_capacity_bytes"] == 16 * GiB
    assert agent.client.kv_limit("m1", 0, operation_id="e")["applied"] is False  # no limit
    m1 = agent.model(agent.client.snapshot(), "m1")
    assert (m1["kv_capacity_bytes"], m1["kv_limit_capped_by"]) == (CAPACITY, None)
    assert read_segment("kvc_m1", agent.shm_dir).total_size == CAPACITY


def _sim_limit(port: int) -> int:
    status, state = http_json(f"http://127.0.0.1:{port}/sim/state")
    assert status == 200
    return int(state["kv"]["limit_bytes"])


def test_a_segment_deleted_under_a_running_engine_holds_no_limit_until_it_is_back(
        agent: AgentProcess) -> None:
    started = agent.activate_sim("m1", kv_limit_bytes=GiB)
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_limit_applied_bytes"] == GiB, what="set")
    path = agent.shm_dir / "kvc_m1"
    os.unlink(path)  # an operator's rm, a tmpfs cleaner: the engine keeps running
    gone = agent.model(agent.wait_for(
        lambda s: "KVSegmentMissing" in agent.model(s, "m1")["conditions"],
        what="the loss reported"), "m1")
    assert gone["phase"] == "active" and gone["kv_segment"]["present"] is False
    assert gone["kv_limit_requested_bytes"] == GiB  # still asked for
    for figure in ("kv_limit_applied_bytes", "kv_capacity_bytes", "kv_total_bytes",
                   "kv_used_bytes"):
        assert gone[figure] is None, figure  # nothing holds a limit; nothing is measured
    reasons = [e["reason"] for e in agent.client.events(0)["events"] if e["model"] == "m1"]
    assert "KVSegmentMissing" in reasons
    waiting = agent.client.kv_limit("m1", GiB, operation_id="while-gone")
    assert waiting["in_force"] is False and "gone" in waiting["message"]
    assert not path.exists()  # the agent never creates a segment

    # A request makes the engine update used_size: kvcached recreates the file zero-filled.
    assert complete(started["port"], "m1")[0] == 200
    back = agent.model(agent.wait_for(
        lambda s: agent.model(s, "m1")["kv_limit_applied_bytes"] == GiB
        and agent.model(s, "m1")["kv_segment"]["present"], what="the limit re-applied"), "m1")
    assert back["conditions"] == [] and back["kv_capacity_bytes"] == GiB
    assert back["kv_startup_capacity_bytes"] == CAPACITY  # a zero-filled file is no capacity
    info = read_segment("kvc_m1", agent.shm_dir)
    assert info is not None and info.total_size == GiB
    assert back["kv_used_bytes"] == info.mapped  # figures from the new segment
    # the engine reads its segment's limit at its own pace: the agent's figures come first
    until_blocking("the engine holds the restored limit", lambda: _sim_limit(started["port"]) == GiB,
                   10, explain=lambda: f"the engine holds {_sim_limit(started['port'])}")
    events = [e["reason"] for e in agent.client.events(0)["events"] if e["model"] == "m1"]
    assert events[-1] == "KVLimitRestored"


def test_a_deleted_segment_without_a_limit_comes_back_with_the_whole_capacity(
        agent: AgentProcess) -> None:
    """A zero-filled segment would read as a capacity of 0, which makes AIBrix's pool
    policy skip the whole Pod: the agent writes back the capacity the engine started with."""
    started = agent.activate_sim("m1")
    _segment_seen(agent, "m1")
    os.unlink(agent.shm_dir / "kvc_m1")
    agent.wait_for(lambda s: "KVSegmentMissing" in agent.model(s, "m1")["conditions"],
                   what="the loss reported")
    assert complete(started["port"], "m1")[0] == 200
    back = agent.model(agent.wait_for(
        lambda s: agent.model(s, "m1")["kv_capacity_bytes"] == CAPACITY
        and not agent.model(s, "m1")["conditions"], what="the capacity written back"), "m1")
    assert back["kv_limit_requested_bytes"] is None
    assert read_segment("kvc_m1", agent.shm_dir).total_size == CAPACITY
