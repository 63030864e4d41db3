"""What an operator sees: the live view in tmux (against an agent and against the demo), its
pure drawing, and engine logs free of the agent's own probes and scrapes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runtime_agent.console import nodeview
from tests.harness import AgentProcess, complete, free_port, sigint_default

ROOT = Path(__file__).resolve().parent.parent
needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
GIB = 2**30


# ---- the drawing, as data ---------------------------------------------------------------------


def _model(name: str, phase: str, hbm: int, kv: int = 0, asleep: int = 0) -> dict[str, object]:
    return {"model_name": name, "engine": "vllm", "simulated": True, "phase": phase,
            "devices": [0], "hbm_bytes": hbm, "kv_used_bytes": kv,
            "sleeping_footprint_bytes": asleep, "restart_count": 0}


def test_a_card_is_split_by_engine_with_kv_asleep_other_and_free() -> None:
    gpu = {"index": 0, "hbm_total_bytes": 80 * GIB, "hbm_used_bytes": 20 * GIB}
    models = [_model("a", "active", 10 * GIB, kv=4 * GIB), _model("b", "sleeping", 6 * GIB,
                                                                   asleep=2 * GIB)]
    segments = nodeview.card_segments(gpu, models)
    assert [(s.label, s.bytes // GIB, s.char) for s in segments] == [
        ("a KV", 4, nodeview.KV_CHAR), ("a", 6, nodeview.HBM_CHAR),
        ("b", 2, nodeview.ASLEEP_CHAR), ("other", 8, nodeview.OTHER_CHAR),
        ("free", 60, nodeview.FREE_CHAR)]
    cells = nodeview.bar(segments, 40)
    assert sum(len(text) for text, _ in cells) == 40
    assert [text for text, _ in cells][0] == nodeview.KV_CHAR * 2


def test_a_tiny_engine_keeps_a_cell_on_its_card() -> None:
    gpu = {"index": 0, "hbm_total_bytes": 1000 * GIB, "hbm_used_bytes": GIB}
    segments = nodeview.card_segments(gpu, [_model("tiny", "active", GIB)])
    cells = nodeview.bar(segments, 20)
    assert cells[0] == (nodeview.HBM_CHAR, nodeview.STYLES[0])
    assert sum(len(text) for text, _ in cells) == 20


# ---- engine logs without the agent's own requests --------------------------------------------


def test_engine_logs_keep_clients_requests_and_not_the_agents_probes(agent: AgentProcess) -> None:
    first = agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    assert complete(first["port"], "m1")[0] == 200
    agent.wait_for(lambda s: (agent.model(s, "m1")["request_success_total"] or 0) >= 1,
                   what="scraped after the request", poll_s=0.1)
    lines = agent.client.logs("m1", 500)["lines"]
    access = [line for line in lines if '" 200' in line]
    assert any("POST /v1/completions" in line for line in access), lines
    for path in ("/metrics", "/health", "/is_sleeping"):
        assert not any(f"GET {path} " in line for line in access), path
    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'aibrix:modelclaim_engine_info{engine="vllm",model="m1",simulated="true"} 1.0' in text


# ---- the live view in tmux --------------------------------------------------------------------


class Pane:
    """A tmux session running one command; ``screen()`` is what a person would see."""

    def __init__(self, command: list[str], width: int = 160, height: int = 40) -> None:
        self.name = f"opx-test-{os.getpid()}-{time.monotonic_ns()}"
        # COLUMNS and LINES (pytest sets them) would override the pane's own size.
        line = "env -u COLUMNS -u LINES TERM=xterm-256color " + " ".join(_quote(w)
                                                                        for w in command)
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", str(width), "-y",
                        str(height), line], check=True, timeout=10, cwd=ROOT)
        subprocess.run(["tmux", "resize-window", "-t", self.name, "-x", str(width), "-y",
                        str(height)], capture_output=True, timeout=10)

    def screen(self) -> str:
        out = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name],
                             capture_output=True, text=True, timeout=10)
        return out.stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True, timeout=10)

    def wait_for(self, test: Callable[[str], bool], what: str, timeout_s: float = 30) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.screen()
            if test(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True,
                       timeout=10)


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


@pytest.fixture
def pane_factory() -> Iterator[Callable[[list[str]], Pane]]:
    made: list[Pane] = []

    def make(command: list[str]) -> Pane:
        pane = Pane(command)
        made.append(pane)
        return pane

    yield make
    for pane in made:
        pane.close()


def row_of(screen: str, model: str) -> str:
    return next((line for line in screen.splitlines() if line.strip().startswith(model + " ")),
                "")


@needs_tmux
@pytest.mark.timeout(120)
def test_top_shows_the_node_and_sleeps_wakes_and_stops_with_keys(
        agent: AgentProcess, pane_factory: Callable[[list[str]], Pane]) -> None:
    agent.activate_sim("alpha")
    agent.activate_sim("beta")
    agent.wait_phase("alpha", "active")
    agent.wait_phase("beta", "active")
    pane = pane_factory([sys.executable, "-m", "runtime_agent.cli", "top", "--url",
                         agent.url.removeprefix("http://")])
    screen = pane.wait_for(lambda s: "active" in row_of(s, "alpha") and "active" in
                           row_of(s, "beta"), "both engines listed")
    assert "SIMULATED engines" in screen and "SIMULATED GPU memory" in screen
    assert "GPU 0" in screen and nodeview.HBM_CHAR in screen and "vllm (sim)" in screen
    pane.keys("s")  # the cursor starts on the first row: alpha
    screen = pane.wait_for(lambda s: "sleeping" in row_of(s, "alpha"), "alpha asleep")
    assert "Slept" in row_of(screen, "alpha") and nodeview.ASLEEP_CHAR in screen
    pane.keys("w")
    pane.wait_for(lambda s: "active" in row_of(s, "alpha") and "Woken" in row_of(s, "alpha"),
                  "alpha awake")
    pane.keys("Down", "x")
    pane.wait_for(lambda s: "press y to confirm" in s, "the stop asks first")
    pane.keys("y")
    pane.wait_for(lambda s: row_of(s, "beta") == "", "beta stopped and gone")
    assert [m["model_name"] for m in agent.client.snapshot()["models"]] == ["alpha"]
    pane.keys("q")


@needs_tmux
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_top_against_the_demo(tmp_path: Path, pane_factory: Callable[[list[str]], Pane]) -> None:
    """The README's path: the demo left running, then the live view on its agent."""
    port, claims_port, door_port = free_port(), free_port(), free_port()
    (tmp_path / "shm").mkdir()
    log = (tmp_path / "demo.log").open("wb")
    # Its own KV directory: the machine's /dev/shm may hold another agent's kvc_<model> names.
    demo = subprocess.Popen([sys.executable, "scripts/demo.py", "--port", str(port),
                             "--claims-port", str(claims_port), "--door-port", str(door_port),
                             "--kv-shm-dir", str(tmp_path / "shm"), "--state-dir",
                             str(tmp_path / "state"), "--keep-running"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=sigint_default)
    try:
        deadline = time.monotonic() + 240
        while "== running until Ctrl-C" not in (tmp_path / "demo.log").read_text():
            assert demo.poll() is None, (tmp_path / "demo.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "demo.log").read_text()
            time.sleep(0.5)
        pane = pane_factory([sys.executable, "-m", "runtime_agent.cli", "top", "--url",
                             f":{port}"])
        screen = pane.wait_for(lambda s: row_of(s, "qwen3-0.6b") != "" and
                               row_of(s, "qwen2.5-0.5b") != "", "the demo's two engines")
        assert "SIMULATED engines" in screen and "GPU 0" in screen
        assert "vllm (sim)" in row_of(screen, "qwen3-0.6b")
        pane.keys("q")
    finally:
        try:
            if demo.poll() is None:
                os.killpg(demo.pid, signal.SIGINT)  # the demo stops its engines and the agent
            try:
                demo.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait(10)
        finally:
            log.close()
