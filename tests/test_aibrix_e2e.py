"""AIBrix's own expectations of the runtime agent, run against ours (issue 22, item 3).

From vllm-project/aibrix: its e2e test ``test/e2e/modelclaim_lifecycle_test.go`` (the snapshot
it reads for an idle model put to sleep and a busy one) and the acceptance steps of its
validation runbook ``development/tutorials/modelclaim/manual-validation-runbook.md`` that speak
to the agent (F4 repeated operation ids, P1 KV capacity after limits, R1 agent restart, R2
engine crash, R3 terminal failure). The parts that need AIBrix's controller, gateway or a
Kubernetes cluster cannot run here; ``docs/aibrix-compat.md`` says which and why. Each test
drives a real agent with simulated engines, as AIBrix's controller would call it.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from runtime_agent.kv.segment import read_segment
from tests.harness import AgentProcess, complete
from tests.test_readoption import restart_agent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FOUR_GIB = 4 * 1024**3
# The runbook's figures for a 4 GiB budget with a 20% floor: the hot model's and the cold one's.
HOT, COLD = 3_435_973_837, 858_993_459


def aibrix_model(snap: dict[str, Any], name: str) -> dict[str, Any]:
    """The fields of ``lifecycleRuntimeSnapshot`` (the e2e test's struct), type-checked as Go's
    decoder would take them (int32 port; bools)."""
    [entry] = [m for m in snap["models"] if m["model_name"] == name]
    picked = {k: entry[k] for k in ("model_name", "port", "phase", "alive", "ready",
                                    "request_metrics_observed")}
    assert type(picked["port"]) is int and 0 <= picked["port"] < 2**31, picked
    assert all(type(picked[k]) is bool for k in ("alive", "ready", "request_metrics_observed"))
    return picked


def test_aibrix_e2e_reads_an_idle_model_asleep_and_a_busy_one_active(agent: AgentProcess) -> None:
    # TestModelClaimLifecycleAndRequestWake: busy and idle claims on one pod, ports 20000 and
    # 20001 (the first two of the pool's range, in activation order); the pool policy puts the
    # idle one to sleep (here: the sleep call the controller makes); then the snapshot.
    busy = agent.activate_sim("lifecycle-busy-model")
    idle = agent.activate_sim("lifecycle-idle-model")
    assert (busy["port"], idle["port"]) == (agent.port_low, agent.port_low + 1)
    for name in ("lifecycle-busy-model", "lifecycle-idle-model"):
        agent.wait_phase(name, "active")
    assert complete(busy["port"], "lifecycle-busy-model")[0] == 200
    agent.client.sleep("lifecycle-idle-model", 1)
    snap = agent.wait_for(lambda s: agent.model(s, "lifecycle-busy-model")
                          ["request_metrics_observed"], what="busy figures read", poll_s=0.05)
    assert aibrix_model(snap, "lifecycle-idle-model") == {
        "model_name": "lifecycle-idle-model", "port": idle["port"], "phase": "sleeping",
        "alive": True, "ready": False, "request_metrics_observed": False}
    assert aibrix_model(snap, "lifecycle-busy-model") == {
        "model_name": "lifecycle-busy-model", "port": busy["port"], "phase": "active",
        "alive": True, "ready": True, "request_metrics_observed": True}
    # the wake brings it back to serving (the e2e's request after the gateway's 503)
    agent.client.wake("lifecycle-idle-model")
    assert complete(idle["port"], "lifecycle-idle-model")[0] == 200
    assert complete(busy["port"], "lifecycle-busy-model")[0] == 200


def test_aibrix_runbook_f4_a_repeated_operation_id_answers_applied_false(
    agent: AgentProcess,
) -> None:
    agent.activate_sim("qwen3-0.6b")
    agent.wait_phase("qwen3-0.6b", "active")
    calls = {
        "limit": lambda: agent.client.kv_limit("qwen3-0.6b", 1024**3, operation_id="run-limit-1"),
        "sleep": lambda: agent.client.sleep("qwen3-0.6b", 1, operation_id="run-sleep-1"),
        "wake": lambda: agent.client.wake("qwen3-0.6b", operation_id="run-wake-1"),
    }
    for what, call in calls.items():
        first, second = call(), call()
        assert (first["applied"], second["applied"]) == (True, False), (what, first, second)
        if what == "sleep":
            assert agent.model(agent.client.snapshot(), "qwen3-0.6b")["phase"] == "sleeping"
    assert agent.wait_phase("qwen3-0.6b", "active")["ready"]


def test_aibrix_runbook_p1_kv_capacity_follows_the_limits_both_ways_as_the_segment_does(
    agent: AgentProcess,
) -> None:
    names = ("qwen3-0.6b", "qwen2.5-0.5b")
    for name in names:
        agent.activate_sim(name, f"--sim-kv-capacity-bytes={FOUR_GIB}")
    for name in names:
        agent.wait_phase(name, "active")
    for hot, cold in (names, names[::-1]):
        agent.client.kv_limit(hot, HOT)
        agent.client.kv_limit(cold, COLD)
        snap = agent.wait_for(lambda s: agent.model(s, hot)["kv_capacity_bytes"] == HOT
                              and agent.model(s, cold)["kv_capacity_bytes"] == COLD,
                              what=f"{hot} hot", poll_s=0.05)
        for name in names:  # "snapshot and kvctl list agree"
            model = agent.model(snap, name)
            segment = read_segment(model["ipc_name"], agent.shm_dir)
            assert segment is not None and segment.total_size == model["kv_capacity_bytes"]
            assert model["kv_limit_applied_bytes"] == model["kv_capacity_bytes"]


def test_aibrix_runbooks_r2_and_r3_restart_then_fail_the_target_and_spare_the_peer(
    agent: AgentProcess,
) -> None:
    target, peer = "qwen3-0.6b", "qwen2.5-0.5b"
    first = {name: agent.activate_sim(name) for name in (target, peer)}
    for name in (target, peer):
        agent.wait_phase(name, "active")
    peer_before = agent.model(agent.client.snapshot(), peer)
    for expected_restart in range(1, 6):  # R2 is the first; R3 drives counts 2 to 5
        pid = agent.model(agent.client.snapshot(), target)["pid"]
        os.kill(pid, signal.SIGKILL)
        model = agent.model(agent.wait_for(
            lambda s: agent.model(s, target)["restart_count"] == expected_restart
            and agent.model(s, target)["phase"] == "active" and agent.model(s, target)["ready"],
            what=f"restart {expected_restart}", poll_s=0.05), target)
        assert model["pid"] != pid
        assert (model["port"], model["ipc_name"]) == (first[target]["port"],
                                                      first[target]["ipc_name"])
        peer_now = agent.model(agent.client.snapshot(), peer)
        assert (peer_now["pid"], peer_now["restart_count"]) == (peer_before["pid"], 0)
        assert complete(first[peer]["port"], peer)[0] == 200
    os.kill(model["pid"], signal.SIGKILL)  # the count-5 process, once more
    failed = agent.wait_phase(target, "failed")
    assert (failed["alive"], failed["ready"], failed["restart_count"]) == (False, False, 5)
    assert failed["last_error"]
    assert complete(first[peer]["port"], peer)[0] == 200


def test_aibrix_runbook_r1_a_restarted_agent_readopts_both_engines_unchanged(
    agent_factory,
) -> None:
    agent: AgentProcess = agent_factory()
    names = ("qwen3-0.6b", "qwen2.5-0.5b")
    for name in names:
        agent.activate_sim(name)
    for name in names:
        agent.wait_phase(name, "active")
    before = {m["model_name"]: (m["pid"], m["port"], m["ipc_name"])
              for m in agent.client.snapshot()["models"]}
    new = restart_agent(agent_factory, agent)
    snap = new.wait_for(lambda s: len(s["models"]) == 2 and all(
        m["phase"] == "active" and m["ready"] for m in s["models"]), what="both back")
    assert {m["model_name"]: (m["pid"], m["port"], m["ipc_name"])
            for m in snap["models"]} == before
    assert all(m["restart_count"] == 0 and m["adopted"] for m in snap["models"])
