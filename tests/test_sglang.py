"""SGLang engines: the command line against SGLang's own flags, and the whole path through the
real agent against the simulator in SGLang mode (activate, figures, sleep, wake, restart,
re-adoption)."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request

import pytest

from engine_http.upstream import Upstream
from engines import sglang
from engines.driver import LaunchContext
from contract.flags import known_flags
from contract.flags import unrecognized
from registry.record import EngineRecord, EngineSpec
from runtime_agent.client import AgentError
from tests.harness import AgentProcess, complete


def _record(args: dict[str, str] | None = None) -> EngineRecord:
    spec = EngineSpec(model_name="qwen3-0.6b", artifact_url="hf://Qwen/Qwen3-0.6B",
                      engine="sglang", ipc_name="kvc_qwen3-0-6b", args=args or {})
    return EngineRecord(engine_id="ab" * 8, spec=spec, port=20007)


def _check_against_sglangs_parser(argv: list[str]) -> None:
    assert unrecognized(argv, known_flags("sglang"), positionals=0) == []


async def test_the_command_line_uses_only_sglangs_own_flags() -> None:
    ctx = LaunchContext(command=("python3", "-m", "sglang.launch_server"), simulated=False,
                        bind_host="0.0.0.0", base_env={"HF_TOKEN": "t"},
                        extra_env={"KVCACHED_IPC_NAME": "kvc_qwen3-0-6b"})
    async with Upstream(timeout=None) as http:
        argv, env = sglang.SglangDriver(http, "127.0.0.1", 20007).command(
            _record({"--context-length": "4096", "--disable-radix-cache": ""}), ctx)
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    _check_against_sglangs_parser(argv[3:])
    assert argv[argv.index("--model-path") + 1] == "Qwen/Qwen3-0.6B"
    assert argv[argv.index("--served-model-name") + 1] == "qwen3-0.6b"
    assert {"--enable-memory-saver", "--enable-weights-cpu-backup", "--enable-metrics"} <= set(argv)
    assert env["KVCACHED_IPC_NAME"] == "kvc_qwen3-0-6b" and "VLLM_SERVER_DEV_MODE" not in env


# ---- through the agent ------------------------------------------------------------------------


def activate_sglang(agent: AgentProcess, name: str, **args: str) -> dict:
    flags = {"--sim-startup-seconds": "0.05", **args}
    return agent.client.activate(name, f"hf://test/{name}", "sglang", args=flags)


def sim_state(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/state", timeout=10) as resp:
        return dict(json.loads(resp.read()))


@pytest.mark.integration
def test_an_sglang_engine_serves_reports_figures_sleeps_and_wakes(agent: AgentProcess) -> None:
    port = activate_sglang(agent, "sg")["port"]
    agent.wait_phase("sg", "active")
    assert complete(port, "sg")[0] == 200
    snap = agent.wait_for(lambda s: agent.model(s, "sg")["request_success_total"] == 1,
                          poll_s=0.1, what="SGLang's counters read")
    assert agent.model(snap, "sg")["request_metrics_observed"] is True
    slept = agent.client.sleep("sg", 2)
    assert slept["phase"] == "sleeping"
    assert sorted(sim_state(port)["released"]) == ["cuda_graph", "kv_cache", "weights"]
    assert agent.model(agent.client.snapshot(), "sg")["sleep_level"] == 1  # weights on the host
    assert agent.client.wake("sg")["phase"] == "active"
    assert sim_state(port)["released"] == [] and complete(port, "sg")[0] == 200


@pytest.mark.integration
def test_an_sglang_engine_with_requests_in_flight_is_not_released(agent: AgentProcess) -> None:
    first = activate_sglang(agent, "sg", **{"--sim-request-seconds": "3"})
    agent.wait_phase("sg", "active")
    busy = threading.Thread(target=complete, args=(first["port"], "sg"))
    busy.start()
    agent.wait_for(lambda s: (agent.model(s, "sg")["requests_running"] or 0) >= 1, poll_s=0.05,
                   what="a request running")
    with pytest.raises(AgentError) as err:
        agent.client.sleep("sg", 1)
    busy.join(30)
    assert err.value.status == 502 and "request(s) running" in str(err.value)
    model = agent.model(agent.client.snapshot(), "sg")
    assert model["phase"] == "active" and model["pid"] == first["pid"]  # SGLang did not go down


@pytest.mark.integration
def test_a_sleeping_sglang_engine_is_readopted_asleep_without_a_health_generation(
        agent_factory) -> None:
    from tests.test_readoption import restart_agent

    agent: AgentProcess = agent_factory()
    first = activate_sglang(agent, "sg")
    agent.wait_phase("sg", "active")
    agent.client.sleep("sg", 1)
    agent.kill()
    new = restart_agent(agent_factory, agent)
    model = new.wait_for(lambda s: new.model(s, "sg")["phase"] == "sleeping"
                         and new.model(s, "sg")["adopted"], timeout_s=10,
                         what="re-adopted asleep")  # /health would hang 20 s on it
    assert new.model(model, "sg")["pid"] == first["pid"]
    assert new.client.wake("sg")["phase"] == "active"
    assert complete(first["port"], "sg")[0] == 200


@pytest.mark.integration
def test_a_crashed_sglang_engine_is_restarted(agent: AgentProcess) -> None:
    first = activate_sglang(agent, "sg")
    agent.wait_phase("sg", "active")
    os.kill(first["pid"], signal.SIGKILL)
    agent.wait_for(lambda s: agent.model(s, "sg")["restart_count"] == 1
                   and agent.model(s, "sg")["phase"] == "active"
                   and agent.model(s, "sg")["pid"] != first["pid"], what="restarted")
