"""Activation credentials reach the engine's environment and nothing else anyone can read."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.harness import AgentProcess

pytestmark = pytest.mark.integration
SECRET = "hf_secret_4f8a1c2e9b7d"


def test_credentials_reach_the_engine_and_no_log_answer_or_readable_file(
        agent: AgentProcess) -> None:
    started = agent.client.activate("m1", "hf://test/m1", "vllm",
                                    args={"--sim-startup-seconds": "0.05"},
                                    credentials={"HF_TOKEN": SECRET})
    agent.wait_phase("m1", "active")
    environ = Path(f"/proc/{started['pid']}/environ").read_bytes().split(b"\0")
    assert f"HF_TOKEN={SECRET}".encode() in environ
    seen = [json.dumps(started), json.dumps(agent.client.snapshot()),
            json.dumps(agent.client.events(0)), json.dumps(agent.client.models()),
            agent.log_tail(10_000)]
    assert not any(SECRET in text for text in seen)
    for path in agent.state_dir.rglob("*"):
        if path.is_file() and SECRET.encode() in path.read_bytes():
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode & 0o077 == 0, f"{path} holds the secret and is readable by others"
            assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0
    assert os.stat(agent.state_dir / "engines").st_mode & 0o077 == 0
