"""The AIBrix sidecar's other routes on the agent: /ready, /v1/models and LoRA adapters, end to end
against the simulator in vLLM and SGLang modes (load, list, serve, restart, re-adoption)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.harness import AgentProcess, complete, http_json

pytestmark = pytest.mark.integration


def call(agent: AgentProcess, method: str, path: str,
         body: dict[str, Any] | None = None) -> tuple[int, Any]:
    return http_json(agent.url + path, method, body)


def test_ready_answers_once_the_agent_has_taken_over_its_engines(agent: AgentProcess) -> None:
    assert call(agent, "GET", "/ready") == (200, {"status": "ready"})


@pytest.fixture
def agent(agent_factory, tmp_path: Path) -> AgentProcess:
    """An agent whose local artifacts (adapters) may come from the test's directory."""
    return agent_factory(extra_args=("--artifact-local-root", str(tmp_path)))


def test_models_lists_every_engine_and_adapter_in_openais_shape(agent: AgentProcess,
                                                                 tmp_path: Path) -> None:
    adapter_dir = tmp_path / "sql-lora"
    adapter_dir.mkdir()
    agent.activate_sim("base", "--enable-lora=")
    agent.activate_sim("other")
    agent.wait_phase("base", "active")
    agent.wait_phase("other", "active")
    code, body = call(agent, "POST", "/v1/lora_adapter/load",
                      {"lora_name": "sql", "lora_path": str(adapter_dir)})
    assert code == 200 and body["model_name"] == "base" and body["loaded"] is True, body
    code, listing = call(agent, "GET", "/v1/models")
    assert code == 200 and listing["object"] == "list"
    cards = {c["id"]: c for c in listing["data"]}
    assert set(cards) == {"base", "other", "sql"}
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == str(adapter_dir)
    assert all(c["object"] == "model" for c in cards.values())


def test_an_adapter_is_served_and_survives_an_engine_restart_and_an_agent_restart(
        agent_factory, tmp_path: Path) -> None:
    from tests.test_readoption import restart_agent

    adapter_dir = tmp_path / "a1"
    adapter_dir.mkdir()
    agent: AgentProcess = agent_factory(extra_args=("--artifact-local-root", str(tmp_path)))
    first = agent.activate_sim("base", "--enable-lora=")
    agent.wait_phase("base", "active")
    code, _ = call(agent, "POST", "/v1/lora_adapter/load",
                   {"lora_name": "a1", "lora_path": str(adapter_dir), "model_name": "base"})
    assert code == 200 and complete(first["port"], "a1")[0] == 200
    os.kill(first["pid"], signal.SIGKILL)  # the new process starts without it
    snap = agent.wait_for(lambda s: agent.model(s, "base")["restart_count"] == 1
                          and agent.model(s, "base")["phase"] == "active"
                          and agent.model(s, "base")["lora_adapters"] == [
                              {"name": "a1", "path": str(adapter_dir), "loaded": True}],
                          what="reloaded after the restart")
    assert complete(agent.model(snap, "base")["port"], "a1")[0] == 200
    agent.kill()
    new = restart_agent(agent_factory, agent)
    new.wait_for(lambda s: new.model(s, "base")["lora_adapters"] == [
        {"name": "a1", "path": str(adapter_dir), "loaded": True}], what="checked after adoption")
    code, _ = call(new, "POST", "/v1/lora_adapter/unload", {"lora_name": "a1"})
    assert code == 200 and complete(first["port"], "a1")[0] == 404


def test_adapter_refusals_say_what_to_fix(agent: AgentProcess, tmp_path: Path) -> None:
    agent.activate_sim("plain")
    agent.wait_phase("plain", "active")
    code, body = call(agent, "POST", "/v1/lora_adapter/load",
                      {"lora_name": "x", "lora_path": str(tmp_path), "model_name": "plain"})
    assert code == 400 and "--enable-lora" in body["message"]
    code, body = call(agent, "POST", "/v1/lora_adapter/load",
                      {"lora_name": "x", "lora_path": "/p", "artifact_url": "hf://a/b"})
    assert code == 422 and len(body["detail"]) >= 2  # both of the sidecar's request shapes
    agent.activate_sim("lora", "--enable-lora=")
    agent.wait_phase("lora", "active")
    code, body = call(agent, "POST", "/v1/lora_adapter/load",
                      {"lora_name": "y", "lora_path": f"{tmp_path}/no-such-adapter"})
    assert code == 400 and "No adapter found" in body["message"]
    code, body = call(agent, "POST", "/v1/lora_adapter/load",
                      {"lora_name": "y", "lora_path": "/etc"})  # outside the roots
    assert code == 403 and "allowed roots" in body["message"]
    code, body = call(agent, "POST", "/v1/lora_adapter/unload", {"lora_name": "never"})
    assert code == 200 and body["applied"] is False


def test_an_sglang_engine_takes_adapters_through_its_own_endpoints(agent: AgentProcess,
                                                                   tmp_path: Path) -> None:
    first = agent.client.activate("sg", "hf://test/sg", "sglang", args={
        "--sim-startup-seconds": "0.05", "--enable-lora": ""})
    agent.wait_phase("sg", "active")
    code, body = call(agent, "POST", "/v1/lora_adapter/load",
                      {"lora_name": "s1", "artifact_url": f"file://{tmp_path}"})
    assert code == 200, body
    assert complete(first["port"], "s1")[0] == 200
    code, body = call(agent, "POST", "/v1/lora_adapter/load",
                      {"lora_name": "s2", "lora_path": f"{tmp_path}/nope"})
    assert code == 400 and "No adapter found" in body["message"]
