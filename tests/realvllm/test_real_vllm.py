"""The agent against a real vLLM (CPU build) serving a small embedding model, end to end.

One agent and one engine for the whole module (a vLLM start costs tens of seconds to minutes on
a CPU), driven through the agent's HTTP API in the order the tests are written: activation,
request figures, the sleep refusal on CPU, an engine crash and restart, re-adoption by a new
agent after the old one was SIGKILLed, and deactivation. vLLM on CPU refuses
``--enable-sleep-mode``, so the agent runs with ``--vllm-sleep-mode off``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import psutil
import pytest

from registry.identity import scan_engines
from runtime_agent.client import AgentError
from tests.harness import AgentProcess

MODEL = "minilm"
# vLLM start-up on two cores: about 25 s in eager mode, a few minutes in the worst case.
BOOT_TIMEOUT_S = 480.0
TEST_TIMEOUT_S = 900
AGENT_ARGS = ["--engines", "vllm", "--vllm-sleep-mode", "off", "--start-stall-timeout", "600"]
# Engine flags for a small BERT embedding model on CPU: the pooling runner, fp32 (fp16 and bf16
# are not fast, or not supported, on every CPU), its own 256-token context, and eager mode (no
# torch.compile warm-up: the start drops from about 60 s to about 25 s).
ENGINE_ARGS = {"--runner": "pooling", "--dtype": "float32", "--max-model-len": "256",
               "--enforce-eager": ""}

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)


@dataclass
class Tier:
    state_dir: Path
    model_dir: Path
    agents: list[AgentProcess] = field(default_factory=list)
    trees: list[list[psutil.Process]] = field(default_factory=list)
    activation: dict[str, Any] = field(default_factory=dict)
    boot_events: list[dict[str, Any]] = field(default_factory=list)
    boot_seconds: float = 0.0

    @property
    def agent(self) -> AgentProcess:
        return self.agents[-1]

    def new_agent(self, port_block: tuple[int, int] | None = None) -> AgentProcess:
        agent = AgentProcess(self.state_dir, extra_args=[
            *AGENT_ARGS, "--artifact-local-root", str(self.model_dir)])
        if port_block is not None:  # the same engine port block as the agent it replaces
            agent.port_low, agent.port_high = port_block
        self.agents.append(agent)
        agent.start(timeout_s=60)
        return agent

    def entry(self) -> dict[str, Any]:
        return self.agent.model(self.agent.client.snapshot(), MODEL)

    def tree(self, pid: int) -> list[psutil.Process]:
        """The engine's process tree now (API server first); kept for the final clean-up."""
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        self.trees.append(procs)
        return procs

    def wait_active(self, what: str, predicate: Any = None) -> dict[str, Any]:
        """Wait for the model to be active (and ``predicate``); fail at once when it failed."""
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        cursor = self.agent.client.events(0)["cursor"]
        while True:
            m = self.entry_or_none()
            if m is not None and m["phase"] == "active" and (predicate is None or predicate(m)):
                return m
            if m is not None and m["phase"] == "failed":
                self.fail(f"{what}: the engine failed", m)
            if time.monotonic() > deadline:
                self.fail(f"{what}: not active after {BOOT_TIMEOUT_S:.0f} s", m)
            cursor = self.agent.client.events(cursor, wait=2)["cursor"]

    def entry_or_none(self) -> dict[str, Any] | None:
        snap = self.agent.client.snapshot()
        return next((m for m in snap["models"] if m["model_name"] == MODEL), None)

    def fail(self, message: str, m: dict[str, Any] | None) -> NoReturn:
        brief = {k: m.get(k) for k in ("phase", "pid", "port", "restart_count")} if m else None
        error = (m or {}).get("last_error") or ""
        pytest.fail(f"{message}; {brief}\n--- last_error (tail):\n{error[-1500:]}\n"
                    f"--- engine log:\n{self.engine_log(30)}\n--- agent log:\n"
                    f"{self.agent.log_tail(30)}", pytrace=False)

    def engine_log(self, lines: int = 60) -> str:
        with contextlib.suppress(AgentError, OSError):
            return "\n".join(self.agent.client.logs(MODEL, lines)["lines"])
        return "(no log)"


def _engine_call(port: int, path: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200, (path, resp.status)
        raw = resp.read()
    return json.loads(raw) if raw.startswith((b"{", b"[")) else raw.decode()


def _embed(port: int, text: str) -> list[float]:
    answer = _engine_call(port, "/v1/embeddings", {"model": MODEL, "input": text})
    vector = answer["data"][0]["embedding"]
    assert len(vector) == 384, len(vector)  # all-MiniLM-L6-v2's width
    return list(vector)


def _labels(procs: list[psutil.Process]) -> list[str]:
    names = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            names.append(" ".join(proc.cmdline())[:80] or proc.name())
    return names


def _survivors(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if p.is_running()]  # is_running checks the create time


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory, model_dir: Path,
         engine_env: None) -> Iterator[Tier]:
    base = tmp_path_factory.mktemp("realvllm")
    t = Tier(state_dir=base / "state", model_dir=model_dir)
    try:
        t.new_agent()
        start = time.monotonic()
        t.activation = t.agent.client.activate(MODEL, str(model_dir), "vllm", args=ENGINE_ARGS)
        t.wait_active("the first vLLM start")
        t.boot_seconds = time.monotonic() - start
        t.boot_events = [e for e in t.agent.client.events(0)["events"] if e["model"] == MODEL]
        yield t
    finally:
        for agent in t.agents:
            agent.cleanup()  # the agent, and every engine process group of this state dir
        for procs in t.trees:  # anything that left its group
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    if proc.is_running():
                        proc.kill()


def test_activation_boots_a_real_vllm_engine(tier: Tier) -> None:
    assert tier.activation["status"] == "success", tier.activation
    assert tier.activation["phase"] in ("activating", "booting"), tier.activation
    moves = [(e["from"], e["to"]) for e in tier.boot_events]
    phases = [to for _, to in moves]
    assert "booting" in phases and "active" in phases, moves
    assert phases.index("booting") < phases.index("active"), moves
    assert "restarting" not in phases and "failed" not in phases, moves

    m = tier.entry()
    assert m["engine"] == "vllm" and m["ready"] is True and m["restart_count"] == 0, m
    assert m["port"] == tier.activation["port"] and m["pid"] == tier.activation["pid"], m
    print(f"\nvLLM start to active: {tier.boot_seconds:.1f} s")

    # vLLM's own API answers on the engine's port, under the model's name.
    _engine_call(m["port"], "/health")
    assert 'vllm:request_success_total{' in _engine_call(m["port"], "/metrics")
    served = [d["id"] for d in _engine_call(m["port"], "/v1/models")["data"]]
    assert served == [MODEL], served
    # A real vLLM process tree: the API server, its EngineCore and the EngineCore's worker,
    # all in the engine's own process group.
    procs = tier.tree(m["pid"])
    labels = _labels(procs)
    assert any("VLLM::EngineCore" in label for label in labels), labels
    assert any("VLLM::Worker" in label for label in labels), labels
    assert {os.getpgid(p.pid) for p in procs} == {m["pid"]}, labels


def test_request_figures_follow_embedding_calls(tier: Tier) -> None:
    port = tier.entry()["port"]
    before = tier.agent.wait_for(
        lambda s: tier.agent.model(s, MODEL)["request_success_total"] is not None, 30,
        "the first request figures", poll_s=0.2)
    total = tier.agent.model(before, MODEL)["request_success_total"]
    _embed(port, "warm pools keep models close")
    _embed(port, "the agent counts what the engine served")
    snap = tier.agent.wait_for(
        lambda s: (tier.agent.model(s, MODEL)["request_success_total"] or 0) >= total + 2, 30,
        "request_success_total to move by 2", poll_s=0.2)
    m = tier.agent.model(snap, MODEL)
    assert m["request_success_total"] == total + 2, m
    assert m["requests_running"] == 0 and m["requests_waiting"] == 0, m
    assert m["request_figures_at"], m


def test_sleep_is_refused_on_cpu(tier: Tier) -> None:
    before = tier.entry()
    with pytest.raises(AgentError) as err:
        tier.agent.client.sleep(MODEL, 1, operation_id="sleep-on-cpu")
    assert err.value.status == 409, err.value.body
    message = str(err.value)
    assert "cannot sleep" in message and "not supported on current platform" in message, message
    after = tier.entry()
    assert after["phase"] == "active" and after["pid"] == before["pid"], after
    _embed(after["port"], "still serving after a refused sleep")


def test_engine_crash_restarts_the_whole_tree_on_the_same_port(tier: Tier) -> None:
    before = tier.entry()
    old = tier.tree(before["pid"])
    assert len(old) >= 3, _labels(old)  # API server, EngineCore, Worker (and helpers)
    os.kill(before["pid"], signal.SIGKILL)

    # The agent kills the rest of the dead leader's group at once: EngineCore and the worker
    # would otherwise hold the port's model (and, on a GPU, its memory).
    survivors = _survivors(old, 60)
    assert not survivors, _labels(survivors)
    with pytest.raises(ProcessLookupError):
        os.killpg(before["pid"], 0)

    after = tier.wait_active("the restarted engine", lambda m: m["pid"] != before["pid"])
    assert after["port"] == before["port"], after
    assert after["restart_count"] == before["restart_count"] + 1, after
    procs = tier.tree(after["pid"])
    assert not {p.pid for p in procs} & {p.pid for p in old if p.is_running()}
    _embed(after["port"], "served again after a crash")


def test_new_agent_readopts_the_engine_without_restarting_it(tier: Tier) -> None:
    old_agent = tier.agent
    before = tier.entry()
    procs = tier.tree(before["pid"])
    old_agent.kill()  # SIGKILL: no goodbye; engines live in their own sessions
    time.sleep(1)
    assert all(p.is_running() for p in procs), _labels(procs)

    new_agent = tier.new_agent(port_block=(old_agent.port_low, old_agent.port_high))
    after = tier.wait_active("the re-adopted engine")
    assert after["pid"] == before["pid"], (before, after)
    assert after["port"] == before["port"], after
    assert after["restart_count"] == before["restart_count"] and after["adopted"] is True, after
    assert all(p.is_running() for p in procs), _labels(procs)  # the same tree, untouched
    restarts = [e for e in new_agent.client.events(0)["events"]
                if e["model"] == MODEL and e["to"] in ("restarting", "booting", "failed")]
    assert not restarts, restarts

    # The new agent watches and scrapes the adopted engine like its own.
    figures = new_agent.wait_for(
        lambda s: new_agent.model(s, MODEL)["request_success_total"] is not None, 30,
        "figures from the adopted engine", poll_s=0.2)
    total = new_agent.model(figures, MODEL)["request_success_total"]
    _embed(after["port"], "served by an adopted engine")
    new_agent.wait_for(
        lambda s: (new_agent.model(s, MODEL)["request_success_total"] or 0) >= total + 1, 30,
        "request_success_total to move after re-adoption", poll_s=0.2)


def test_deactivate_leaves_no_process_of_the_tree(tier: Tier) -> None:
    m = tier.entry()
    procs = tier.tree(m["pid"])
    assert len(procs) >= 3, _labels(procs)
    result = tier.agent.client.deactivate(MODEL)
    assert result["status"] == "success", result

    def gone(snap: dict[str, Any]) -> bool:
        entry = next((e for e in snap["models"] if e["model_name"] == MODEL), None)
        return entry is None or entry["phase"] == "stopped"

    tier.agent.wait_for(gone, 60, "the model to stop")
    survivors = _survivors(procs, 30)
    assert not survivors, _labels(survivors)
    assert scan_engines(str(tier.state_dir)) == []
