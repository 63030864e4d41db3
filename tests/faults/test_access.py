"""Who may drive an agent, and when: one agent per state directory, a token for strangers,
events that know their boot, and a failed engine brought back by activating it again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from runtime_agent.client import AgentClient, AgentError
from tests.harness import ROOT, AgentProcess, http_json
from tests.test_readoption import restart_agent

pytestmark = pytest.mark.integration


def test_a_second_agent_on_the_same_state_directory_exits_at_once_naming_the_first(
        agent_factory) -> None:
    first: AgentProcess = agent_factory()
    second: AgentProcess = agent_factory(state_dir=first.state_dir, start=False)
    argv = [sys.executable, "-m", "runtime_agent.cli", "serve", "--host", "127.0.0.1",
            "--port", str(second.port), "--state-dir", str(first.state_dir), "--engines", "sim"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert first.proc is not None and f"pid {first.proc.pid}" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    first.activate_sim("m1")  # the first agent is untouched
    first.wait_phase("m1", "active")


def test_with_a_token_strangers_can_read_health_but_change_nothing(
        agent_factory, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    agent: AgentProcess = agent_factory(start=False, extra_args=("--token-file", str(token_file)))
    agent.client = AgentClient(agent.url, timeout_s=60, token="s3cret-token")
    agent.start()
    body = {"model_name": "m1", "artifact_url": "hf://test/m1", "engine": "vllm"}
    code, answer = http_json(agent.url + "/v1/runtime/models/activate", "POST", body)
    assert code == 401 and "bearer token" in answer["message"]
    assert "s3cret" not in json.dumps(answer)
    for path in ("/healthz", "/ready"):
        assert http_json(agent.url + path)[0] == 200
    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as resp:  # scrapes: open
        assert resp.status == 200
    assert agent.activate_sim("m1")["status"] == "success"  # with the token
    env = {**os.environ, "RUNTIME_AGENT_TOKEN": "s3cret-token"}
    out = subprocess.run([sys.executable, "-m", "runtime_agent.cli", "deactivate", "m1",
                          "--url", agent.url], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    wrong = AgentClient(agent.url, token="guess")
    with pytest.raises(AgentError) as err:
        wrong.activate("m2", "hf://test/m2", "vllm")
    assert err.value.status == 401 and "not this agent's" in str(err.value)


def test_events_after_a_restart_carry_the_new_boot_and_an_old_cursor_is_told_to_relist(
        agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    before = agent.client.events(0)
    new = restart_agent(agent_factory, agent)
    code, stale = http_json(f"{new.url}/v1/runtime/events?since={before['cursor']}"
                            f"&boot_id={before['boot_id']}")
    assert code == 200 and stale["reset"] is True and stale["events"] == []
    fresh = new.client.events(0)
    assert fresh["boot_id"] != before["boot_id"]
    assert all(e["boot_id"] == fresh["boot_id"] for e in fresh["events"])


def test_activating_a_failed_engine_again_starts_it_over_and_says_so(agent_factory) -> None:
    agent: AgentProcess = agent_factory(restart_delays="")
    agent.activate_sim("m1", "--sim-crash-after=0.5")
    agent.wait_phase("m1", "failed", timeout_s=30)
    again = agent.activate_sim("m1", "--sim-crash-after=0.5")
    assert again["applied"] is True and "fresh restart budget" in again["message"]
    assert agent.wait_phase("m1", "failed", timeout_s=30)["restart_count"] == 0
