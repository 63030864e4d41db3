"""The real agent process against simulated-engine processes: activate, serve, sleep, wake, stop."""

from __future__ import annotations

import os

import psutil
import pytest

from runtime_agent.client import AgentError
from tests.harness import AgentProcess, complete

pytestmark = pytest.mark.integration

SNAPSHOT_FIELDS = {
    "model_name", "engine", "artifact_url", "claim_ref", "port", "ipc_name", "pid", "phase",
    "alive", "ready", "restart_count", "last_error", "last_transition", "requests_running",
    "requests_waiting", "request_success_total",
}


def test_activated_engine_becomes_active_on_a_port_in_range(agent: AgentProcess) -> None:
    result = agent.activate_sim("qwen3-0.6b", claim_ref={"namespace": "default",
                                                         "name": "qwen3-0-6b", "uid": "u1"})
    assert result["status"] == "success"
    assert agent.port_low <= result["port"] <= agent.port_high
    assert result["ipc_name"] == "kvc_qwen3-0-6b"
    model = agent.wait_phase("qwen3-0.6b", "active")
    assert SNAPSHOT_FIELDS <= model.keys()
    assert model["ready"] is True and model["alive"] is True
    assert model["port"] == result["port"] and model["pid"] == result["pid"]
    assert model["claim_ref"] == {"namespace": "default", "name": "qwen3-0-6b", "uid": "u1"}
    snap = agent.client.snapshot()
    assert {"observed_at", "accelerators", "models", "cached_artifacts"} <= snap.keys()
    # Served is not cached: only artifacts really in the weight cache are listed (none here).
    assert snap["cached_artifacts"] == []
    short = agent.client.models()["models"]
    assert [m["model_name"] for m in short] == ["qwen3-0.6b"]


def test_request_figures_in_the_snapshot_follow_the_engine(agent: AgentProcess) -> None:
    port = agent.activate_sim("m1")["port"]
    agent.wait_phase("m1", "active")
    for _ in range(3):
        assert complete(port, "m1")[0] == 200
    snap = agent.wait_for(lambda s: agent.model(s, "m1")["request_success_total"] == 3,
                          what="three successful requests scraped", poll_s=0.05)
    assert agent.model(snap, "m1")["requests_running"] == 0


def test_activating_again_with_the_same_spec_returns_the_same_port(agent: AgentProcess) -> None:
    first = agent.activate_sim("m1")
    again = agent.activate_sim("m1")
    assert again["port"] == first["port"] and again["pid"] == first["pid"]
    with pytest.raises(AgentError) as err:
        agent.activate_sim("m1", "--max-model-len=4096")
    assert err.value.status == 409 and "args" in str(err.value)


def test_sleep_and_wake_move_the_engine_and_repeat_by_operation_id(agent: AgentProcess) -> None:
    port = agent.activate_sim("m1")["port"]
    agent.wait_phase("m1", "active")
    slept = agent.client.sleep("m1", 1, operation_id="op-1")
    assert slept == {"status": "success", "model_name": "m1", "operation_id": "op-1",
                     "applied": True, "in_force": True, "phase": "sleeping"}
    assert agent.model(agent.client.snapshot(), "m1")["phase"] == "sleeping"
    status, body = complete(port, "m1")
    assert status == 503
    # The same operation id does nothing more, and says so (applied: false, as AIBrix reads it).
    events_before = agent.client.events(0)["cursor"]
    assert agent.client.sleep("m1", 1, operation_id="op-1") == {**slept, "applied": False}
    assert agent.client.events(0)["cursor"] == events_before
    woke = agent.client.wake("m1", operation_id="op-2")
    assert woke["applied"] is True and woke["phase"] == "active"
    assert complete(port, "m1")[0] == 200
    # Waking an awake engine is a success that applied nothing.
    assert agent.client.wake("m1")["applied"] is False


def test_a_failed_wake_is_reported_and_the_engine_stays_asleep(agent: AgentProcess) -> None:
    agent.activate_sim("m1", "--sim-fail-wake")
    agent.wait_phase("m1", "active")
    agent.client.sleep("m1")
    with pytest.raises(AgentError) as err:
        agent.client.wake("m1")
    assert err.value.status == 502
    assert err.value.body["phase"] == "sleeping"
    assert agent.model(agent.client.snapshot(), "m1")["phase"] == "sleeping"


def test_deactivate_stops_the_whole_process_tree(agent: AgentProcess) -> None:
    pid = agent.activate_sim("m1", "--sim-spawn-child")["pid"]
    agent.wait_phase("m1", "active")
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    assert len(tree) >= 2
    result = agent.client.deactivate("m1")
    assert result["status"] == "success" and result["phase"] == "stopped"
    gone, alive = psutil.wait_procs(tree, timeout=5)
    assert alive == []
    assert agent.client.snapshot()["models"] == []
    assert list((agent.state_dir / "engines").glob("*.json")) == []
    # Deactivating a model that does not run is a no-op success.
    assert agent.client.deactivate("m1")["status"] == "success"


def test_stopping_the_agent_leaves_engines_running(agent: AgentProcess) -> None:
    pid = agent.activate_sim("m1")["pid"]
    agent.wait_phase("m1", "active")
    assert agent.terminate() == 0
    assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    os.kill(pid, 0)
