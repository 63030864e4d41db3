"""Engine kinds through the real agent: Ollama load/unload, vLLM sleep levels, stuck starts."""

from __future__ import annotations

import json
import urllib.request

import pytest

from runtime_agent.client import AgentError
from tests.harness import AgentProcess

pytestmark = pytest.mark.integration


def activate_ollama(agent: AgentProcess, name: str, **args: str) -> dict:
    flags = {"--sim-startup-seconds": "0.05", "--sim-load-seconds": "0.1",
             "--context-length": "8192", "--num-parallel": "2", **args}
    return agent.client.activate(name, f"ollama://{name}", "ollama", args=flags)


def ollama_ps(port: int) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/ps", timeout=10) as resp:
        return list(json.loads(resp.read())["models"])


def test_an_ollama_model_loads_reports_its_footprint_and_sleeps_by_unloading(
    agent: AgentProcess,
) -> None:
    port = activate_ollama(agent, "qwen3:0.6b")["port"]
    model = agent.wait_phase("qwen3:0.6b", "active")
    assert [m["name"] for m in ollama_ps(port)] == ["qwen3:0.6b"]
    snap = agent.wait_for(lambda s: agent.model(s, "qwen3:0.6b")["context_length"] == 8192,
                          poll_s=0.05, what="footprint and context reported")
    model = agent.model(snap, "qwen3:0.6b")
    assert model["observed_footprint_bytes"] == ollama_ps(port)[0]["size_vram"] > 0
    assert agent.client.sleep("qwen3:0.6b", 1)["phase"] == "sleeping"
    assert ollama_ps(port) == []  # unloaded, the server stays
    assert agent.client.wake("qwen3:0.6b")["phase"] == "active"
    assert [m["name"] for m in ollama_ps(port)] == ["qwen3:0.6b"]


def test_an_ollama_model_that_cannot_load_fails_with_the_reason(agent_factory) -> None:
    agent: AgentProcess = agent_factory(restart_delays="0.05")
    activate_ollama(agent, "ghost:1b", **{"--sim-missing-model": "ghost:1b"})
    model = agent.wait_phase("ghost:1b", "failed", timeout_s=30)
    assert "not found" in model["last_error"] and "start-up failed" in model["last_error"]


def test_a_level_2_sleep_wakes_with_weights_reloaded(agent: AgentProcess) -> None:
    port = agent.activate_sim("m1")["port"]
    agent.wait_phase("m1", "active")
    assert agent.client.sleep("m1", 2)["phase"] == "sleeping"
    assert agent.model(agent.client.snapshot(), "m1")["sleep_level"] == 2
    assert agent.client.wake("m1")["phase"] == "active"
    body = json.dumps({"model": "m1", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:  # 500 if the weights were garbage
        assert resp.status == 200


def test_where_vllm_cannot_sleep_sleep_requests_get_409_with_the_reason(agent_factory) -> None:
    agent: AgentProcess = agent_factory(extra_args=["--vllm-sleep-mode", "off"])
    agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    with pytest.raises(AgentError) as err:
        agent.client.sleep("m1", 1)
    assert err.value.status == 409 and "not supported on current platform" in str(err.value)
    log = "\n".join(agent.client.logs("m1", 50)["lines"])
    assert "--enable-sleep-mode" not in log.split("engine start")[1].splitlines()[0]


def test_a_start_that_makes_no_progress_is_ended_with_its_log_tail(agent_factory) -> None:
    agent: AgentProcess = agent_factory(restart_delays="0.05",
                                        extra_args=["--start-stall-timeout", "3"])
    agent.activate_sim("stuck", "--sim-hang-on-start")
    model = agent.wait_phase("stuck", "failed", timeout_s=30)
    assert "made no progress" in model["last_error"]
    assert "Loading model" in model["last_error"]  # the tail of the engine's own log
    assert model["restart_count"] == 1
