"""The simulator takes as long as the model it stands for (engines/sim/timing.py), and reports
``finish_reason`` as vLLM does: "length" when ``max_tokens`` cut the answer short, "stop" when the
answer ended on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

from engines.sim import timing
from contract.quantity import GiB as GIB
from engines.sim.options import parse_options
from engines.sim.textgen import answer_length, finish_reason
from tests.harness import SimProcess, engine_port

ROOT = Path(__file__).resolve().parent.parent
SIZES = st.integers(min_value=0, max_value=2 * 1024 * GIB)


@given(SIZES, SIZES)
def test_a_bigger_model_never_starts_or_wakes_faster(a: int, b: int) -> None:
    small, big = sorted((a, b))
    assert timing.start_seconds(small) <= timing.start_seconds(big)
    for level in (1, 2):
        assert timing.wake_seconds(small, level) <= timing.wake_seconds(big, level)
        assert timing.sleep_seconds(small, level) <= timing.sleep_seconds(big, level)
    assert timing.reload_seconds(small) <= timing.reload_seconds(big)


@given(SIZES)
def test_every_time_is_capped_and_a_level_2_wake_with_its_reload_is_never_the_faster(size: int) -> None:
    assert timing.START_FIXED_S <= timing.start_seconds(size) <= timing.START_CAP_S
    for level in (1, 2):
        assert 0 < timing.wake_seconds(size, level) <= timing.WAKE_CAP_S
        assert 0 < timing.sleep_seconds(size, level) <= timing.WAKE_CAP_S
    assert 0 <= timing.reload_seconds(size) <= timing.WAKE_CAP_S
    assert timing.wake_seconds(size, 2) == timing.wake_seconds(size, 1, weights=False)  # maps only
    assert timing.wake_seconds(size, 1) <= timing.wake_seconds(size, 2) + timing.reload_seconds(size)


def test_the_figures_match_what_vllm_is_measured_to_take() -> None:
    """1 GiB of weights (a 0.5B model in bf16): the vLLM blog's level-1 wake of ~0.1-0.4 s and
    level-2 wake (with its reload) of ~0.8 s; a 16 GiB (8B) model wakes from level 1 in about a
    second."""
    assert 0.1 < timing.wake_seconds(GIB, 1) < 0.4
    assert 0.7 < timing.wake_seconds(GIB, 2) + timing.reload_seconds(GIB) < 1.0
    assert 2.0 < timing.start_seconds(GIB) < 3.0
    assert 1.0 < timing.wake_seconds(16 * GIB, 1) < 2.0
    assert timing.reload_seconds(16 * GIB) == timing.WAKE_CAP_S  # 11.5 s, capped


def test_options_take_the_start_time_from_the_declared_size_unless_told() -> None:
    assert parse_options(["serve", "m"], {}).startup_seconds == timing.start_seconds(GIB)
    big = parse_options(["serve", "m", "--sim-memory-bytes", str(8 * GIB)], {})
    assert big.startup_seconds == timing.start_seconds(8 * GIB) > timing.start_seconds(GIB)
    assert parse_options(["serve", "m", "--sim-startup-seconds", "0"], {}).startup_seconds == 0.0
    assert parse_options(["serve", "m"], {"SIM_STARTUP_SECONDS": "0"}).startup_seconds == 0.0
    defaults = parse_options(["serve", "m"], {})
    assert (defaults.sleep_seconds, defaults.wake_seconds) == (None, None)  # by level, at the time
    assert parse_options(["serve", "m"], {"SIM_WAKE_SECONDS": "0"}).wake_seconds == 0.0
    assert parse_options(["serve", "--sim-mode", "ollama"], {}).startup_seconds == 0.5


@given(st.text(max_size=40), st.integers(min_value=1, max_value=1000))
def test_an_answer_ends_on_its_own_or_at_max_tokens_and_says_which(prompt: str, max_tokens: int) -> None:
    count, reason = finish_reason(prompt, max_tokens)
    assert 1 <= count <= max_tokens
    if reason == "length":
        assert count == max_tokens <= answer_length(prompt)
    else:
        assert reason == "stop" and count == answer_length(prompt) < max_tokens


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimProcess]:
    """A simulated vLLM of 3 GiB of weights on its defaults: no --sim-*-seconds, no SIM_* env."""
    port = engine_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIM_")}
    env["VLLM_SERVER_DEV_MODE"] = "1"
    log = tmp_path / "sim.log"
    launched = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engines.sim", "serve", "t/m", "--served-model-name", "m",
             "--host", "127.0.0.1", "--port", str(port), "--enable-sleep-mode",
             "--sim-memory-bytes", str(3 * GIB)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    engine = SimProcess(proc, port, log, launched)
    try:
        yield engine
    finally:
        engine.kill_group()


def _chat(url: str, max_tokens: int, stream: bool = False) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=10, stream=stream, json={
        "model": "m", "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens, "stream": stream})


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_real_simulated_engine_starts_and_wakes_as_long_as_its_size_says(sim: SimProcess) -> None:
    sim.wait_ready(timeout=30)
    started = time.monotonic() - sim.launched_at
    assert started >= timing.start_seconds(3 * GIB), started
    size = 3 * GIB
    for level, steps in ((1, ["/wake_up"]), (2, ["/wake_up?tags=weights", "/collective_rpc",
                                                 "/wake_up?tags=kv_cache"])):  # as the agent wakes
        assert requests.post(sim.url + "/sleep", params={"level": level}, timeout=30).status_code == 200
        began = time.monotonic()
        for step in steps:
            body = {"method": "reload_weights"} if step == "/collective_rpc" else None
            assert requests.post(sim.url + step, json=body, timeout=30).status_code == 200
        took = time.monotonic() - began
        expected = (timing.wake_seconds(size, 1) if level == 1 else
                    2 * timing.wake_seconds(size, 2) + timing.reload_seconds(size))
        assert expected <= took < expected + 2, (level, took)
    short = _chat(sim.url, 4).json()
    assert (short["choices"][0]["finish_reason"], short["usage"]["completion_tokens"]) == ("length", 4)
    whole = _chat(sim.url, 1000).json()
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == answer_length("user: Say hello.") < 1000
    completion = requests.post(sim.url + "/v1/completions", timeout=10, json={
        "model": "m", "prompt": "hello", "max_tokens": 1000}).json()
    assert completion["choices"][0]["finish_reason"] == "stop"
    with _chat(sim.url, 1000, stream=True) as streamed:
        events = [line[6:] for line in streamed.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "stop"
    with _chat(sim.url, 3, stream=True) as streamed:
        events = [line[6:] for line in streamed.iter_lines() if line.startswith(b"data: ")]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    metrics = requests.get(sim.url + "/metrics", timeout=10).text
    assert 'finished_reason="length",model_name="m"} 2.0' in metrics
    assert 'finished_reason="stop",model_name="m"} 3.0' in metrics
