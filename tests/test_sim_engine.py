"""The simulated vLLM engine, run as a real process, behaves like `vllm serve` towards a supervisor.

Every test starts `python -m engines.sim serve ...` in its own session on a free port and kills the
whole process group afterwards, so no engine (or engine child) outlives its test.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from engines.sim.kvcache import KvCache
from contract.quantity import GiB as GIB
from engines.sim.options import OptionsError, parse_options
from runtime_agent.kv.segment import (
    SegmentInfo,
    SegmentReplaced,
    read_segment,
    write_limit,
)

pytestmark = pytest.mark.timeout(30)

from engines.sim.gpu_report import GpuReport
from tests.harness import SimProcess, engine_port, port_is_open, wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_FLAGS = ["--gpu-memory-utilization", "0.9", "--max-model-len", "2048", "--trust-remote-code",
              "--kv-cache-dtype", "auto", "--compilation-config", '{"level": 3}', "--seed", "-1"]





async def async_wait_for(predicate: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval)
    return await predicate()


Sim = SimProcess


def _kill_group(sim: Sim) -> None:
    sim.kill_group()


Launcher = Callable[..., Sim]


def _launch(tmp_dir: Path, sims: list[Sim], *flags: str, dev_mode: bool = True, env: dict[str, str] | None = None,
            startup: float = 0.05, model_args: tuple[str, ...] = ("facebook/opt-125m",), ready: bool = True,
            sleep_mode: bool = True) -> Sim:
    """Start one engine (recorded in ``sims`` for the group kill) and by default wait for its port."""
    port = engine_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SIM_") and k != "VLLM_SERVER_DEV_MODE"}
    full_env.update(SIM_SLEEP_SECONDS="0", SIM_WAKE_SECONDS="0", SIM_RELOAD_SECONDS="0")  # fast unless a test says otherwise
    if dev_mode:
        full_env["VLLM_SERVER_DEV_MODE"] = "1"
    full_env.update(env or {})
    argv = [sys.executable, "-m", "engines.sim", "serve", *model_args, "--served-model-name", "opt",
            "--host", "127.0.0.1", "--port", str(port),
            *(["--enable-sleep-mode"] if sleep_mode else []), *VLLM_FLAGS,
            "--sim-startup-seconds", str(startup), *flags]
    log_path = tmp_dir / f"sim-{port}.log"
    launched_at = time.monotonic()  # before Popen: the engine cannot start any clock earlier than this
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=full_env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sim = Sim(proc, port, log_path, launched_at)
    sims.append(sim)
    if ready:
        sim.wait_ready()
    return sim


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    sims: list[Sim] = []

    def start(*flags: str, **kwargs: Any) -> Sim:
        return _launch(tmp_path, sims, *flags, **kwargs)

    try:
        yield start
    finally:
        for sim in sims:
            _kill_group(sim)


@pytest.fixture(scope="module")
def shared_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """One plain engine for the tests that only read."""
    sims: list[Sim] = []
    try:
        yield _launch(tmp_path_factory.mktemp("shared"), sims)
    finally:
        for sim in sims:
            _kill_group(sim)


async def get_metric(session: aiohttp.ClientSession, sim: Sim, name: str, **labels: str) -> float:
    async with session.get(f"{sim.url}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        label_text, value = line[len(name) + 1:].rsplit("} ", 1)
        found = dict(part.split("=", 1) for part in label_text.split(","))
        if all(found.get(k) == f'"{v}"' for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"{name}{labels} not in metrics:\n{text}")


async def post_json(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    return [block.removeprefix("data: ") for block in raw.split("\n\n") if block]


# --- command line ---------------------------------------------------------------------------------


def test_command_line_takes_real_vllm_flags_it_does_not_model_with_their_values() -> None:
    options = parse_options(["serve", "m", "--served-model-name", "n", *VLLM_FLAGS, "--port", "9"], {})
    assert (options.model, options.served_model_name, options.port, options.max_model_len) == ("m", "n", 9, 2048)
    assert "--gpu-memory-utilization" in options.ignored_args and "-1" in options.ignored_args
    assert parse_options(["serve", "m", "--max_model_len=100"], {}).max_model_len == 100


@pytest.mark.parametrize("argv, refused", [
    (["serve", "m", "--foo", "1"], "--foo 1"),  # no such vLLM flag (1 is no second model)
    (["serve", "m", "--swap-space", "4"], "--swap-space 4"),  # gone from vLLM 0.32
    (["serve", "m", "--model-path", "x"], "--model-path x"),  # SGLang's, not vLLM's
    (["serve", "m", "stray"], "stray"),  # one positional only
    (["serve", "--model-path", "m", "--sim-mode", "sglang", "--max-model-len", "8"], "--max-model-len 8"),
    (["serve", "m", "--sim-mode", "ollama", "--num-parallel", "2"], "--num-parallel 2"),
    (["serve", "m", "--sim-no-such-knob"], "--sim-no-such-knob"),
])
def test_command_line_refuses_what_the_real_engine_would_refuse(
        argv: list[str], refused: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(OptionsError, match=f"unrecognized arguments: {refused}$"):
        parse_options(argv, {})
    assert f"error: unrecognized arguments: {refused}" in capsys.readouterr().err


def test_a_refused_command_line_exits_2_with_argparses_words() -> None:
    out = subprocess.run([sys.executable, "-m", "engines.sim", "serve", "m", "--foo"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "error: unrecognized arguments: --foo" in out.stderr


def test_sim_flags_fall_back_to_env_and_the_flag_wins() -> None:
    env = {"SIM_STARTUP_SECONDS": "2.5", "SIM_FAIL_WAKE": "1", "SIM_MEMORY_BYTES": "123"}
    options = parse_options(["serve", "m"], env)
    assert (options.startup_seconds, options.fail_wake, options.memory_bytes) == (2.5, True, 123)
    options = parse_options(["serve", "m", "--sim-startup-seconds", "0"], env)
    assert options.startup_seconds == 0.0
    assert parse_options(["serve", "m"], {}).memory_bytes == GIB
    assert parse_options(["serve", "m", "--sim-reload-seconds", "1.5"], {}).reload_seconds == 1.5
    assert parse_options(["serve", "m"], {"SIM_RELOAD_SECONDS": "0.25"}).reload_seconds == 0.25
    with pytest.raises(OptionsError):
        parse_options(["serve", "m", "--sim-mode", "sglang"], {})
    with pytest.raises(OptionsError):
        parse_options(["serve"], {})  # vLLM mode needs a model


# --- start-up and plain endpoints -----------------------------------------------------------------


def test_port_stays_closed_until_startup_delay_ends(launch: Launcher) -> None:
    sim = launch(startup=1.0, ready=False)
    while time.monotonic() - sim.launched_at < 0.7:
        is_open = port_is_open(sim.port)
        # judged by the time after the probe, so a probe delayed past the 1 s mark cannot fail the test
        assert not (is_open and time.monotonic() - sim.launched_at < 1.0)
        time.sleep(0.05)
    sim.wait_ready()
    assert time.monotonic() - sim.launched_at >= 1.0
    assert "Application startup complete." in sim.log()


def test_hung_engine_never_opens_its_port_and_stops_logging(launch: Launcher) -> None:
    sim = launch(startup=0.0, ready=False, env={"SIM_HANG_ON_START": "1"})  # env fallback of --sim-hang-on-start
    assert wait_until(lambda: "Loading model" in sim.log(), timeout=10.0)  # however slowly Python starts
    assert not wait_until(lambda: port_is_open(sim.port), timeout=0.8)  # with startup 0 it would be open by now
    assert sim.proc.poll() is None
    assert "Started server process" not in sim.log()


async def test_health_and_models_report_the_served_model_name(shared_sim: Sim) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{shared_sim.url}/health") as response:
            assert response.status == 200 and await response.read() == b""
        async with session.get(f"{shared_sim.url}/v1/models") as response:
            models = await response.json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["opt"]
    assert models["data"][0]["root"] == "facebook/opt-125m"


async def test_model_can_be_given_with_the_model_flag(launch: Launcher) -> None:
    sim = launch(model_args=("--model", "org/other"))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{sim.url}/sim/state") as response:
            state = await response.json()
    assert state["model"] == "org/other" and state["memory_bytes"] == GIB


# --- inference ------------------------------------------------------------------------------------


async def test_completions_are_deterministic_and_shaped_like_openai(shared_sim: Sim) -> None:
    url = f"{shared_sim.url}/v1/completions"
    async with aiohttp.ClientSession() as session:
        _, first = await post_json(session, url, {"model": "opt", "prompt": "hello world", "max_tokens": 5})
        _, again = await post_json(session, url, {"model": "opt", "prompt": "hello world", "max_tokens": 5})
        status, other = await post_json(session, url, {"prompt": "something else"})
    assert status == 200
    assert first["object"] == "text_completion" and first["model"] == "opt"
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert len(first["choices"][0]["text"].split()) == 5
    assert first["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert other["usage"]["completion_tokens"] == 16
    assert other["choices"][0]["text"] != first["choices"][0]["text"]


async def test_chat_completions_answer_with_an_assistant_message(shared_sim: Sim) -> None:
    body = {"model": "opt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with aiohttp.ClientSession() as session:
        status, reply = await post_json(session, f"{shared_sim.url}/v1/chat/completions", body)
    assert status == 200 and reply["object"] == "chat.completion"
    choice = reply["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"].split()) == 4
    assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 4  # cut short


async def test_streaming_sends_server_sent_events_ending_in_done(shared_sim: Sim) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "opt", "prompt": "stream me", "max_tokens": 3, "stream": True}
        async with session.post(f"{shared_sim.url}/v1/completions", json=body) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(await response.text())
        _, plain = await post_json(session, f"{shared_sim.url}/v1/completions", {**body, "stream": False})
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}
        async with session.post(f"{shared_sim.url}/v1/chat/completions", json=chat) as response:
            chat_events = sse_events(await response.text())
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # 3 tokens cut the answer short
    chat_chunks = [json.loads(e) for e in chat_events[:-1]]
    assert chat_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chat_chunks)
    assert chat_chunks[-1]["usage"]["completion_tokens"] == 3


async def test_wrong_model_gets_404_and_invalid_json_gets_400(shared_sim: Sim) -> None:
    async with aiohttp.ClientSession() as session:
        status, error = await post_json(session, f"{shared_sim.url}/v1/completions", {"model": "nope", "prompt": "x"})
        assert status == 404 and error["object"] == "error" and "nope" in error["error"]["message"]
        async with session.post(f"{shared_sim.url}/v1/chat/completions", data=b"{not json") as response:
            assert response.status == 400 and (await response.json())["code"] == 400


# --- sleep mode -----------------------------------------------------------------------------------


async def is_sleeping(session: aiohttp.ClientSession, sim: Sim) -> bool:
    async with session.get(f"{sim.url}/is_sleeping") as response:
        assert response.status == 200
        return bool((await response.json())["is_sleeping"])


async def post_status(session: aiohttp.ClientSession, url: str, **kwargs: Any) -> int:
    async with session.post(url, **kwargs) as response:
        await response.read()
        return response.status


async def test_sleeping_engine_refuses_inference_stays_healthy_and_serves_after_waking(launch: Launcher) -> None:
    sim = launch()
    completion = f"{sim.url}/v1/completions"
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{sim.url}/sleep", params={"level": "1"}) as response:
            assert response.status == 200
        async with session.get(f"{sim.url}/is_sleeping") as response:
            assert await response.json() == {"is_sleeping": True}
        status, error = await post_json(session, completion, {"prompt": "x"})
        assert status == 503 and error["error"]["code"] == 503
        async with session.get(f"{sim.url}/health") as response:
            assert response.status == 200
        state = await sim_state(session, sim)
        assert state["level"] == 1 and state["awake"] == {"weights": False, "kv_cache": False}
        assert state["weights_valid"] and state["memory"]["host_bytes"] == GIB  # offloaded, not discarded
        async with session.post(f"{sim.url}/wake_up") as response:
            assert response.status == 200
        async with session.get(f"{sim.url}/is_sleeping") as response:
            assert await response.json() == {"is_sleeping": False}
        status, _ = await post_json(session, completion, {"prompt": "x"})
        assert status == 200


async def test_the_gpu_report_shows_a_sleep_or_wake_before_the_call_answers(launch: Launcher,
                                                                            tmp_path: Path) -> None:
    """As NVML shows freed memory the moment vLLM's sleep returns, the report is written before the
    answer: a reader right after the call never sees the memory of before it."""
    channel = tmp_path / "gpu"
    channel.mkdir()
    sim = launch(env={"AIBRIX_SIM_GPU_DIR": str(channel), "CUDA_VISIBLE_DEVICES": "0"})
    report = channel / f"{sim.proc.pid}.json"
    assert wait_until(report.exists, 5)
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            assert await post_status(session, f"{sim.url}/sleep", params={"level": "1"}) == 200
            asleep = GpuReport.from_json(report.read_text())
            assert (asleep.weights_bytes, asleep.kv_bytes, asleep.host_bytes) == (0, 0, GIB)
            assert await post_status(session, f"{sim.url}/wake_up") == 200
            awake = GpuReport.from_json(report.read_text())
            assert (awake.weights_bytes, awake.host_bytes) == (GIB, 0)


async def test_level_one_sleep_woken_tag_by_tag_keeps_valid_weights(launch: Launcher) -> None:
    sim = launch()
    async with aiohttp.ClientSession() as session:
        assert await post_status(session, f"{sim.url}/sleep", params={"level": "1"}) == 200
        assert await post_status(session, f"{sim.url}/wake_up", params={"tags": "weights"}) == 200
        assert await is_sleeping(session, sim)  # true until every tag is awake
        status, _ = await post_json(session, f"{sim.url}/v1/completions", {"prompt": "x"})
        assert status == 503
        assert await post_status(session, f"{sim.url}/wake_up", params={"tags": "kv_cache"}) == 200
        assert not await is_sleeping(session, sim)
        status, _ = await post_json(session, f"{sim.url}/v1/completions", {"prompt": "x"})
        assert status == 200


async def test_level_two_sleep_woken_without_reload_fails_inference_with_500(launch: Launcher) -> None:
    sim = launch()
    async with aiohttp.ClientSession() as session:
        assert await post_status(session, f"{sim.url}/sleep", params={"level": "2"}) == 200
        state = await sim_state(session, sim)
        assert (state["level"], state["weights_valid"], state["memory"]["host_bytes"]) == (2, False, 0)
        assert await post_status(session, f"{sim.url}/wake_up") == 200  # a plain wake maps empty memory
        assert not await is_sleeping(session, sim)
        for path, body in [("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
            status, error = await post_json(session, f"{sim.url}{path}", body)
            assert status == 500 and error["error"]["code"] == 500
            assert "discarded by a level-2 sleep and never reloaded" in error["error"]["message"]
        state = await sim_state(session, sim)
        assert state["awake"] == {"weights": True, "kv_cache": True} and not state["weights_valid"]


async def test_level_two_sleep_comes_back_with_weights_wake_reload_and_kv_wake(launch: Launcher) -> None:
    sim = launch("--sim-reload-seconds", "0.3")
    rpc = f"{sim.url}/collective_rpc"
    async with aiohttp.ClientSession() as session:
        assert await post_status(session, f"{sim.url}/sleep", params={"level": "2"}) == 200
        status, error = await post_json(session, rpc, {"method": "reload_weights"})
        assert status == 500 and "not allocated" in error["error"]["message"]  # nothing mapped to load into
        assert await post_status(session, f"{sim.url}/wake_up", params={"tags": "weights"}) == 200
        state = await sim_state(session, sim)
        assert state["awake"] == {"weights": True, "kv_cache": False} and await is_sleeping(session, sim)
        started = time.monotonic()
        status, reply = await post_json(session, rpc, {"method": "reload_weights"})
        assert (status, reply) == (200, {"results": [None]}) and time.monotonic() - started >= 0.3
        assert (await sim_state(session, sim))["weights_valid"]
        assert await is_sleeping(session, sim)
        assert await post_status(session, f"{sim.url}/wake_up", params={"tags": "kv_cache"}) == 200
        assert not await is_sleeping(session, sim)
        status, _ = await post_json(session, f"{sim.url}/v1/completions", {"prompt": "x"})
        assert status == 200
        assert "wake up the engine with tags: ['weights']" in sim.log()


async def test_sleep_while_asleep_and_wake_of_an_awake_tag_change_nothing(launch: Launcher) -> None:
    sim = launch()
    async with aiohttp.ClientSession() as session:
        assert await post_status(session, f"{sim.url}/sleep", params={"level": "1"}) == 200
        assert await post_status(session, f"{sim.url}/sleep", params={"level": "2"}) == 200  # vLLM: a no-op
        state = await sim_state(session, sim)
        assert state["level"] == 1 and state["weights_valid"]
        assert await post_status(session, f"{sim.url}/wake_up", params={"tags": "weights"}) == 200
        # naming a tag that is already awake makes the whole call a no-op, as in vLLM's executor
        assert await post_status(session, f"{sim.url}/wake_up", params=[("tags", "weights"),
                                                                         ("tags", "kv_cache")]) == 200
        assert (await sim_state(session, sim))["awake"] == {"weights": True, "kv_cache": False}
        assert "is not in sleeping tags" in sim.log()


async def test_collective_rpc_needs_dev_mode_and_a_method(launch: Launcher) -> None:
    sim = launch()
    rpc = f"{sim.url}/collective_rpc"
    async with aiohttp.ClientSession() as session:
        status, reply = await post_json(session, rpc, {"args": []})
        assert status == 400 and reply == {"detail": "Missing 'method' in request body"}
        async with session.post(rpc, data=b"{nope") as response:
            assert response.status == 400 and "JSON decode error" in (await response.json())["detail"]
        status, reply = await post_json(session, rpc, {"method": "frobnicate"})
        assert status == 500 and "frobnicate" in reply["error"]["message"]
        status, reply = await post_json(session, rpc, {"method": "reload_weights"})  # awake: reload in place
        assert (status, reply) == (200, {"results": [None]})
    plain = launch(dev_mode=False)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{plain.url}/collective_rpc", json={"method": "reload_weights"}) as response:
            assert response.status == 404


@pytest.mark.parametrize(("dev_mode", "sleep_flag"), [(False, True), (True, False)])
async def test_sleep_endpoints_are_missing_without_dev_mode_and_sleep_flag(
    launch: Launcher, dev_mode: bool, sleep_flag: bool
) -> None:
    sim = launch(dev_mode=dev_mode, sleep_mode=sleep_flag)
    async with aiohttp.ClientSession() as session:
        for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]:
            async with session.request(method, f"{sim.url}{path}") as response:
                assert response.status == 404, path
        async with session.get(f"{sim.url}/health") as response:
            assert response.status == 200


async def test_failed_wake_returns_500_and_the_engine_stays_asleep(launch: Launcher) -> None:
    sim = launch("--sim-fail-wake")
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{sim.url}/sleep") as response:
            assert response.status == 200
        async with session.post(f"{sim.url}/wake_up") as response:
            assert response.status == 500
        async with session.get(f"{sim.url}/is_sleeping") as response:
            assert await response.json() == {"is_sleeping": True}


async def test_slow_sleep_does_not_block_health_or_metrics(launch: Launcher) -> None:
    sim = launch("--sim-sleep-seconds", "5.0")  # a blocked GET would take seconds, an unblocked one milliseconds
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        sleeping = asyncio.create_task(session.post(f"{sim.url}/sleep", params={"level": "1"}))

        async def falling_asleep() -> bool:
            return bool((await sim_state(session, sim))["transition"] == "sleeping")

        assert await async_wait_for(falling_asleep, timeout=3.0)  # the GETs below run during the sleep
        assert not sleeping.done()
        for path in ("/health", "/metrics", "/is_sleeping"):
            before = time.monotonic()
            async with session.get(f"{sim.url}{path}") as response:
                assert response.status == 200
            assert time.monotonic() - before < 1.5, path
        assert not sleeping.done()
        async with await sleeping as response:
            assert response.status == 200
        assert time.monotonic() - started >= 5.0
        async with session.get(f"{sim.url}/is_sleeping") as response:
            assert await response.json() == {"is_sleeping": True}


# --- metrics --------------------------------------------------------------------------------------


async def test_metrics_count_running_waiting_and_successful_requests(launch: Launcher) -> None:
    sim = launch("--sim-request-seconds", "2", "--sim-max-running", "1")
    async with aiohttp.ClientSession() as session:
        assert await get_metric(session, sim, "vllm:num_requests_running", model_name="opt") == 0
        before = await get_metric(session, sim, "vllm:request_success_total", model_name="opt", finished_reason="length")
        url = f"{sim.url}/v1/completions"
        requests = [asyncio.create_task(post_json(session, url, {"prompt": f"p{i}"})) for i in range(3)]

        async def one_running_two_waiting() -> bool:
            running = await get_metric(session, sim, "vllm:num_requests_running", model_name="opt")
            waiting = await get_metric(session, sim, "vllm:num_requests_waiting", model_name="opt")
            return (running, waiting) == (1, 2)

        assert await async_wait_for(one_running_two_waiting, timeout=5.0)  # true for most of the first 2 s
        assert [status for status, _ in await asyncio.gather(*requests)] == [200, 200, 200]
        after = await get_metric(session, sim, "vllm:request_success_total", model_name="opt", finished_reason="length")
        assert after - before == 3
        assert await get_metric(session, sim, "vllm:num_requests_running", model_name="opt") == 0
        assert await get_metric(session, sim, "vllm:num_requests_waiting", model_name="opt") == 0
        async with session.get(f"{sim.url}/sim/state") as response:
            assert (await response.json())["success_total"] == 3


async def test_streamed_tokens_are_spaced_by_token_seconds(launch: Launcher) -> None:
    token_s = 0.3
    sim = launch("--sim-token-seconds", str(token_s))
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "slow", "max_tokens": 4, "stream": True}
        sent = time.monotonic()
        async with session.post(f"{sim.url}/v1/completions", json=body) as response:
            arrivals = []
            async for line in response.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic() - sent)
    tokens = arrivals[:4]  # then the chunk with the finish reason
    assert len(tokens) == 4
    # Token k leaves the engine k * token_s after the request came in, which is after `sent`: a lower
    # bound that a loaded machine only makes later (gaps seen by the client can shrink, this cannot).
    assert all(at >= k * token_s for k, at in enumerate(tokens)), tokens
    # Not all held back and sent together: only a stall of over 2 * token_s in reading the first token
    # could bring the last within token_s of it.
    assert tokens[3] - tokens[0] >= token_s, tokens


# --- process lifecycle ----------------------------------------------------------------------------


def test_crash_after_exits_abruptly_with_the_given_code(launch: Launcher) -> None:
    sim = launch("--sim-crash-after", "0.5", "--sim-crash-exit-code", "7", startup=0.0)
    assert sim.wait_exit(timeout=10.0) == 7
    assert time.monotonic() - sim.launched_at >= 0.5
    assert "simulated crash" in sim.log()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_termination_signal_exits_zero_promptly_even_mid_stream(
    launch: Launcher, signum: signal.Signals
) -> None:
    sim = launch("--sim-spawn-child", "--sim-token-seconds", "10")  # the next token is 10 s away
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "long", "max_tokens": 100, "stream": True}
        async with session.post(f"{sim.url}/v1/completions", json=body) as response:
            assert (await response.content.readline()).startswith(b"data: {")
            sim.proc.send_signal(signum)
            assert sim.wait_exit(timeout=3.0) == 0  # does not wait for the stream, nor its next token
    assert "Finished server process" in sim.log()


def test_termination_during_startup_exits_zero(launch: Launcher) -> None:
    sim = launch(startup=10.0, ready=False)
    assert wait_until(lambda: "Loading model" in sim.log(), timeout=10.0)
    sim.proc.terminate()
    assert sim.wait_exit(timeout=3.0) == 0  # well before the 10 s start-up would end


def _child_of(sim: Sim) -> psutil.Process:
    engine = psutil.Process(sim.proc.pid)
    assert wait_until(lambda: bool(engine.children()), timeout=5.0)
    children: list[psutil.Process] = engine.children()
    assert len(children) == 1
    return children[0]


def _gone(process: psutil.Process) -> bool:
    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def test_spawned_child_shares_the_group_and_dies_when_the_group_is_killed(launch: Launcher) -> None:
    sim = launch("--sim-spawn-child")
    child = _child_of(sim)
    assert os.getpgid(child.pid) == os.getpgid(sim.proc.pid) == sim.proc.pid
    assert child.is_running() and not _gone(child)
    os.killpg(sim.proc.pid, signal.SIGKILL)
    assert wait_until(lambda: _gone(child), timeout=3.0)


def test_clean_shutdown_also_stops_the_spawned_child(launch: Launcher) -> None:
    sim = launch("--sim-spawn-child")
    child = _child_of(sim)
    sim.proc.terminate()
    assert sim.wait_exit(timeout=3.0) == 0
    assert wait_until(lambda: _gone(child), timeout=5.0)


# --- kvcached segment -----------------------------------------------------------------------------

MIB = 1024**2


def kv_env(shm_dir: Path, name: str = "opt-kv") -> dict[str, str]:
    return {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1", "KVCACHED_IPC_NAME": name,
            "KVCACHED_SHM_DIR": str(shm_dir)}


async def sim_state(session: aiohttp.ClientSession, sim: Sim) -> dict[str, Any]:
    async with session.get(f"{sim.url}/sim/state") as response:
        assert response.status == 200
        state: dict[str, Any] = await response.json()
        return state


def segment(shm_dir: Path, name: str = "opt-kv") -> SegmentInfo | None:
    return read_segment(name, shm_dir)


async def segment_used_becomes(shm_dir: Path, used: int, timeout: float) -> bool:
    async def check() -> bool:
        return getattr(segment(shm_dir), "used_size", None) == used

    return await async_wait_for(check, timeout)


def test_kv_flags_fall_back_to_env_and_kvcached_comes_from_its_environment() -> None:
    options = parse_options(["serve", "m"], {})
    assert (options.kv_capacity_bytes, options.kv_bytes_per_request) == (2 * GIB, 64 * MIB)
    assert (options.kv_page_bytes, options.kv_layers, options.kvcached_ipc_name) == (2 * MIB, 1, None)
    options = parse_options(["serve", "m", "--sim-kv-bytes-per-request", "5000000", "--sim-kv-layers", "3"],
                            {"SIM_KV_PAGE_BYTES": str(MIB), "ENABLE_KVCACHED": "True",
                             "KVCACHED_IPC_NAME": "Qwen/Qwen3 0.6B", "KVCACHED_SHM_DIR": "/tmp/x"})
    assert options.kv_request_bytes == 6 * MIB  # 5,000,000 bytes rounded up to whole 1 MiB pages x 3 layers
    assert (options.kvcached_ipc_name, options.kvcached_shm_dir) == ("Qwen-Qwen3-0-6B", "/tmp/x")
    assert parse_options(["serve", "m"], {"KVCACHED_IPC_NAME": "n"}).kvcached_ipc_name is None
    assert parse_options(["serve", "m"], {"ENABLE_KVCACHED": "1"}).kvcached_ipc_name is None
    with pytest.raises(OptionsError):
        parse_options(["serve", "m", "--sim-kv-page-bytes", "0"], {})


async def test_segment_appears_with_the_capacity_when_the_port_opens(launch: Launcher, tmp_path: Path) -> None:
    sim = launch("--sim-kv-capacity-bytes", str(512 * MIB), startup=1.0, ready=False, env=kv_env(tmp_path))
    while time.monotonic() - sim.launched_at < 0.7:
        exists = segment(tmp_path) is not None
        # judged by the time after the read, so a read delayed past the 1 s mark cannot fail the test
        assert not (exists and time.monotonic() - sim.launched_at < 1.0)
        time.sleep(0.05)
    sim.wait_ready()
    info = segment(tmp_path)
    assert info is not None and (info.total_size, info.used_size, info.prealloc_size) == (512 * MIB, 0, 0)
    assert oct((tmp_path / "opt-kv").stat().st_mode & 0o777) == oct(0o666)
    async with aiohttp.ClientSession() as session:
        kv = (await sim_state(session, sim))["kv"]
    assert (kv["capacity_bytes"], kv["limit_bytes"], kv["used_bytes"], kv["inode"]) == (512 * MIB, 512 * MIB, 0, info.inode)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".log")) == ["opt-kv"]


async def test_engine_without_kvcached_creates_no_segment(launch: Launcher, tmp_path: Path) -> None:
    sim = launch(env={"KVCACHED_IPC_NAME": "opt-kv", "KVCACHED_SHM_DIR": str(tmp_path)})
    async with aiohttp.ClientSession() as session:
        assert (await sim_state(session, sim))["kv"] is None
    assert segment(tmp_path) is None


async def test_used_kv_grows_with_running_requests_and_shrinks_after(launch: Launcher, tmp_path: Path) -> None:
    # 3 MiB per request in 1 MiB pages on 2 layers: 4 MiB each.
    sim = launch("--sim-request-seconds", "2.5", "--sim-kv-bytes-per-request", str(3 * MIB),
                 "--sim-kv-page-bytes", str(MIB), "--sim-kv-layers", "2", env=kv_env(tmp_path))
    async with aiohttp.ClientSession() as session:
        url = f"{sim.url}/v1/completions"
        requests = [asyncio.create_task(post_json(session, url, {"prompt": f"p{i}"})) for i in range(3)]
        assert await segment_used_becomes(tmp_path, 12 * MIB, timeout=5.0)  # for the 2.5 s the three run
        assert (await sim_state(session, sim))["kv"]["used_bytes"] == 12 * MIB
        assert [status for status, _ in await asyncio.gather(*requests)] == [200, 200, 200]
        info = segment(tmp_path)
        assert info is not None and (info.total_size, info.used_size, info.prealloc_size) == (2 * GIB, 0, 0)


async def test_the_gpu_report_follows_kv_in_use_as_requests_come_and_go(launch: Launcher,
                                                                       tmp_path: Path) -> None:
    """The report is written by whoever changed the memory (nothing polls it): a request's KV is
    in the report while the request runs and gone once it answered."""
    channel = tmp_path / "gpu"
    channel.mkdir()
    sim = launch("--sim-request-seconds", "1.5", "--sim-kv-bytes-per-request", str(3 * MIB),
                 "--sim-kv-page-bytes", str(MIB), "--sim-kv-layers", "2",
                 env={**kv_env(tmp_path), "AIBRIX_SIM_GPU_DIR": str(channel),
                      "CUDA_VISIBLE_DEVICES": "0"})
    report = channel / f"{sim.proc.pid}.json"
    assert wait_until(report.exists, 5)
    assert GpuReport.from_json(report.read_text()).kv_bytes == 0
    async with aiohttp.ClientSession() as session:
        url = f"{sim.url}/v1/completions"
        requests = [asyncio.create_task(post_json(session, url, {"prompt": f"p{i}"}))
                    for i in range(2)]
        assert await segment_used_becomes(tmp_path, 8 * MIB, timeout=5.0)
        assert GpuReport.from_json(report.read_text()).kv_bytes == 8 * MIB  # written with it
        assert [status for status, _ in await asyncio.gather(*requests)] == [200, 200]
    assert GpuReport.from_json(report.read_text()).kv_bytes == 0  # before the answers came


async def test_a_limit_below_use_keeps_live_kv_and_makes_new_requests_wait(launch: Launcher, tmp_path: Path) -> None:
    request_s = 3.0  # everything up to the gather below happens while the first three run
    sim = launch("--sim-request-seconds", str(request_s), "--sim-kv-bytes-per-request", str(8 * MIB),
                 "--sim-kv-capacity-bytes", str(64 * MIB), env=kv_env(tmp_path))
    async with aiohttp.ClientSession() as session:
        url = f"{sim.url}/v1/completions"
        first = [asyncio.create_task(post_json(session, url, {"prompt": f"p{i}"})) for i in range(3)]
        assert await segment_used_becomes(tmp_path, 24 * MIB, timeout=5.0)
        started = time.monotonic()
        written = write_limit("opt-kv", 8 * MIB, tmp_path)
        assert (written.total_size, written.used_size) == (8 * MIB, 24 * MIB)  # live KV is never evicted

        async def limit_applied() -> bool:
            return bool((await sim_state(session, sim))["kv"]["limit_bytes"] == 8 * MIB)

        assert await async_wait_for(limit_applied, timeout=2.0)  # the 100 ms watch picks it up
        late = asyncio.create_task(post_json(session, url, {"prompt": "late"}))

        async def late_waits() -> bool:
            state = await sim_state(session, sim)
            return bool(state["waiting"] == 1 and state["running"] == 3 and state["kv"]["waiting_for_kv"] == 1)

        assert await async_wait_for(late_waits, timeout=2.0)
        assert await get_metric(session, sim, "vllm:num_requests_waiting", model_name="opt") == 1
        info = segment(tmp_path)
        assert info is not None and (info.total_size, info.used_size) == (8 * MIB, 24 * MIB)
        assert [status for status, _ in await asyncio.gather(*first)] == [200, 200, 200]

        async def late_runs() -> bool:
            state = await sim_state(session, sim)
            return bool(state["running"] == 1 and state["waiting"] == 0 and state["kv"]["used_bytes"] == 8 * MIB)

        assert await async_wait_for(late_runs, timeout=2.0)  # then it runs for request_s
        assert getattr(segment(tmp_path), "used_size", None) == 8 * MIB
        status, _ = await late
        assert status == 200 and time.monotonic() - started >= request_s
        assert getattr(segment(tmp_path), "used_size", None) == 0


async def test_raising_the_limit_lets_waiting_requests_run(launch: Launcher, tmp_path: Path) -> None:
    sim = launch("--sim-request-seconds", "5", "--sim-kv-bytes-per-request", str(8 * MIB),
                 "--sim-kv-capacity-bytes", str(64 * MIB), env=kv_env(tmp_path))
    write_limit("opt-kv", 8 * MIB, tmp_path)
    async with aiohttp.ClientSession() as session:
        url = f"{sim.url}/v1/completions"
        requests = [asyncio.create_task(post_json(session, url, {"prompt": f"p{i}"})) for i in range(3)]

        async def counts(running: int, waiting: int) -> bool:
            state = await sim_state(session, sim)
            return bool((state["running"], state["waiting"]) == (running, waiting))

        # both states hold until the first request ends, 5 s after it started
        assert await async_wait_for(lambda: counts(1, 2), timeout=2.0)  # the new limit applied on allocation
        write_limit("opt-kv", 1 << 40, tmp_path)  # above the capacity: the engine holds what it has
        assert await async_wait_for(lambda: counts(3, 0), timeout=2.0)  # the 100 ms watch picks it up
        assert (await sim_state(session, sim))["kv"]["limit_bytes"] == 64 * MIB
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)


def _write_total_raw(path: Path, total: int) -> None:
    """What a careless writer could do: put 0 in total_size (write_limit refuses to)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, struct.pack("=q", total), 0)
    finally:
        os.close(fd)


async def test_a_limit_of_zero_is_ignored(launch: Launcher, tmp_path: Path) -> None:
    sim = launch("--sim-kv-capacity-bytes", str(64 * MIB), "--sim-kv-bytes-per-request", str(8 * MIB),
                 env=kv_env(tmp_path))
    write_limit("opt-kv", 32 * MIB, tmp_path)
    async with aiohttp.ClientSession() as session:

        async def limit_is(value: int) -> bool:
            return bool((await sim_state(session, sim))["kv"]["limit_bytes"] == value)

        assert await async_wait_for(lambda: limit_is(32 * MIB), timeout=2.0)  # the 100 ms watch picks it up
        _write_total_raw(tmp_path / "opt-kv", 0)
        await asyncio.sleep(0.3)  # three watch periods
        assert await limit_is(32 * MIB)
        status, _ = await post_json(session, f"{sim.url}/v1/completions", {"prompt": "still serving"})
        assert status == 200 and await limit_is(32 * MIB)


async def test_a_restarted_engine_resets_its_segment_with_a_new_inode(launch: Launcher, tmp_path: Path) -> None:
    first = launch("--sim-kv-capacity-bytes", str(64 * MIB), env=kv_env(tmp_path))
    before = write_limit("opt-kv", 16 * MIB, tmp_path)
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    leftover = segment(tmp_path)
    assert leftover is not None and (leftover.total_size, leftover.inode) == (16 * MIB, before.inode)
    second = launch("--sim-kv-capacity-bytes", str(64 * MIB), env=kv_env(tmp_path))
    after = segment(tmp_path)
    assert after is not None and (after.total_size, after.used_size, after.prealloc_size) == (64 * MIB, 0, 0)
    assert after.inode != before.inode
    with pytest.raises(SegmentReplaced):
        write_limit("opt-kv", 8 * MIB, tmp_path, expected_inode=before.inode)
    async with aiohttp.ClientSession() as session:
        assert (await sim_state(session, second))["kv"]["limit_bytes"] == 64 * MIB


def test_sigterm_removes_the_segment_and_sigkill_leaves_it(launch: Launcher, tmp_path: Path) -> None:
    sim = launch(env=kv_env(tmp_path, "clean"))
    assert segment(tmp_path, "clean") is not None
    sim.proc.terminate()
    assert sim.wait_exit(timeout=3.0) == 0
    assert segment(tmp_path, "clean") is None
    assert "KV segment" in sim.log() and "removed" in sim.log()
    killed = launch(env=kv_env(tmp_path, "killed"))
    os.killpg(killed.proc.pid, signal.SIGKILL)
    killed.proc.wait()
    assert segment(tmp_path, "killed") is not None


async def test_a_request_that_gives_up_waiting_for_kv_leaves_the_queue(tmp_path: Path) -> None:
    kv = KvCache("unit", str(tmp_path), capacity=16 * MIB, request_bytes=8 * MIB)
    kv.create()
    write_limit("unit", 8 * MIB, tmp_path)
    holding, release = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def request(name: str) -> None:
        async with kv.allocation():
            order.append(name)
            holding.set()
            await release.wait()

    first = asyncio.create_task(request("first"))
    await holding.wait()
    assert kv.limit == 8 * MIB  # applied lazily, on this allocation
    quitter = asyncio.create_task(request("quitter"))
    patient = asyncio.create_task(request("patient"))
    await asyncio.sleep(0.05)
    assert kv.snapshot()["waiting_for_kv"] == 2 and order == ["first"]
    quitter.cancel()
    await asyncio.gather(quitter, return_exceptions=True)
    assert kv.snapshot()["waiting_for_kv"] == 1
    release.set()
    await asyncio.wait_for(asyncio.gather(first, patient), timeout=1.0)
    assert order == ["first", "patient"] and kv.used == 0
    assert getattr(segment(tmp_path, "unit"), "used_size", None) == 0
    assert kv.remove() and segment(tmp_path, "unit") is None
