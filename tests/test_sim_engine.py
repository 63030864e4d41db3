"""The simulated vLLM engine, run as a real process, behaves like `vllm serve` towards a supervisor.

Every test starts `python -m engines.sim serve ...` in its own session on a free port and kills the
whole process group afterwards, so no engine (or engine child) outlives its test.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from engines.sim.options import GIB, OptionsError, parse_options

pytestmark = pytest.mark.timeout(30)

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_FLAGS = ["--gpu-memory-utilization", "0.9", "--max-model-len", "2048", "--trust-remote-code",
              "--kv-cache-dtype", "auto", "--compilation-config", '{"level": 3}', "--swap-space", "-1"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


async def async_wait_for(predicate: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval)
    return await predicate()


@dataclass
class Sim:
    """One running simulated engine."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    launched_at: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 10.0) -> None:
        ok = wait_for(lambda: port_is_open(self.port) or self.proc.poll() is not None, timeout)
        assert ok and self.proc.poll() is None, f"engine did not start:\n{self.log()}"

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


def _kill_group(sim: Sim) -> None:
    try:
        os.killpg(sim.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    sim.proc.wait()


Launcher = Callable[..., Sim]


def _launch(tmp_dir: Path, sims: list[Sim], *flags: str, dev_mode: bool = True, env: dict[str, str] | None = None,
            startup: float = 0.05, model_args: tuple[str, ...] = ("facebook/opt-125m",), ready: bool = True,
            sleep_mode: bool = True) -> Sim:
    """Start one engine (recorded in ``sims`` for the group kill) and by default wait for its port."""
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SIM_") and k != "VLLM_SERVER_DEV_MODE"}
    if dev_mode:
        full_env["VLLM_SERVER_DEV_MODE"] = "1"
    full_env.update(env or {})
    argv = [sys.executable, "-m", "engines.sim", "serve", *model_args, "--served-model-name", "opt",
            "--host", "127.0.0.1", "--port", str(port),
            *(["--enable-sleep-mode"] if sleep_mode else []), *VLLM_FLAGS,
            "--sim-startup-seconds", str(startup), *flags]
    log_path = tmp_dir / f"sim-{port}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=full_env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sim = Sim(proc, port, log_path, time.monotonic())
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


def test_command_line_ignores_unknown_vllm_flags_and_their_values() -> None:
    options = parse_options(["serve", "m", "--served-model-name", "n", *VLLM_FLAGS, "--port", "9"], {})
    assert (options.model, options.served_model_name, options.port, options.max_model_len) == ("m", "n", 9, 2048)
    assert "--gpu-memory-utilization" in options.ignored_args and "-1" in options.ignored_args
    assert parse_options(["serve", "--model", "m", "--foo", "1"], {}).served_model_name == "m"


def test_sim_flags_fall_back_to_env_and_the_flag_wins() -> None:
    env = {"SIM_STARTUP_SECONDS": "2.5", "SIM_FAIL_WAKE": "1", "SIM_MEMORY_BYTES": "123"}
    options = parse_options(["serve", "m"], env)
    assert (options.startup_seconds, options.fail_wake, options.memory_bytes) == (2.5, True, 123)
    options = parse_options(["serve", "m", "--sim-startup-seconds", "0"], env)
    assert options.startup_seconds == 0.0
    assert parse_options(["serve", "m"], {}).memory_bytes == GIB
    with pytest.raises(OptionsError):
        parse_options(["serve", "m", "--sim-mode", "ollama"], {})


# --- start-up and plain endpoints -----------------------------------------------------------------


def test_port_stays_closed_until_startup_delay_ends(launch: Launcher) -> None:
    sim = launch(startup=1.0, ready=False)
    while time.monotonic() - sim.launched_at < 0.7:
        assert not port_is_open(sim.port)
        time.sleep(0.05)
    sim.wait_ready()
    assert time.monotonic() - sim.launched_at >= 1.0
    assert "Application startup complete." in sim.log()


def test_hung_engine_never_opens_its_port_and_stops_logging(launch: Launcher) -> None:
    sim = launch(startup=0.0, ready=False, env={"SIM_HANG_ON_START": "1"})  # env fallback of --sim-hang-on-start
    assert not wait_for(lambda: port_is_open(sim.port), timeout=0.8)
    assert sim.proc.poll() is None
    assert "Loading model" in sim.log() and "Started server process" not in sim.log()


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
    assert choice["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 4


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
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
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


async def test_sleeping_engine_refuses_inference_stays_healthy_and_serves_after_waking(launch: Launcher) -> None:
    sim = launch()
    completion = f"{sim.url}/v1/completions"
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{sim.url}/sleep", params={"level": "2"}) as response:
            assert response.status == 200
        async with session.get(f"{sim.url}/is_sleeping") as response:
            assert await response.json() == {"is_sleeping": True}
        status, error = await post_json(session, completion, {"prompt": "x"})
        assert status == 503 and error["error"]["code"] == 503
        async with session.get(f"{sim.url}/health") as response:
            assert response.status == 200
        async with session.get(f"{sim.url}/sim/state") as response:
            assert (await response.json())["level"] == 2
        async with session.post(f"{sim.url}/wake_up") as response:
            assert response.status == 200
        async with session.get(f"{sim.url}/is_sleeping") as response:
            assert await response.json() == {"is_sleeping": False}
        status, _ = await post_json(session, completion, {"prompt": "x"})
        assert status == 200


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
    sim = launch("--sim-sleep-seconds", "1.0")
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        sleeping = asyncio.create_task(session.post(f"{sim.url}/sleep", params={"level": "1"}))
        await asyncio.sleep(0.1)
        assert not sleeping.done()
        for path in ("/health", "/metrics", "/is_sleeping"):
            before = time.monotonic()
            async with session.get(f"{sim.url}{path}") as response:
                assert response.status == 200
            assert time.monotonic() - before < 0.3, path
        assert not sleeping.done()
        async with await sleeping as response:
            assert response.status == 200
        assert time.monotonic() - started >= 1.0
        async with session.get(f"{sim.url}/is_sleeping") as response:
            assert await response.json() == {"is_sleeping": True}


# --- metrics --------------------------------------------------------------------------------------


async def test_metrics_count_running_waiting_and_successful_requests(launch: Launcher) -> None:
    sim = launch("--sim-request-seconds", "0.6", "--sim-max-running", "1")
    async with aiohttp.ClientSession() as session:
        assert await get_metric(session, sim, "vllm:num_requests_running", model_name="opt") == 0
        before = await get_metric(session, sim, "vllm:request_success_total", model_name="opt", finished_reason="stop")
        url = f"{sim.url}/v1/completions"
        requests = [asyncio.create_task(post_json(session, url, {"prompt": f"p{i}"})) for i in range(3)]

        async def one_running_two_waiting() -> bool:
            running = await get_metric(session, sim, "vllm:num_requests_running", model_name="opt")
            waiting = await get_metric(session, sim, "vllm:num_requests_waiting", model_name="opt")
            return (running, waiting) == (1, 2)

        assert await async_wait_for(one_running_two_waiting, timeout=0.55)
        assert [status for status, _ in await asyncio.gather(*requests)] == [200, 200, 200]
        after = await get_metric(session, sim, "vllm:request_success_total", model_name="opt", finished_reason="stop")
        assert after - before == 3
        assert await get_metric(session, sim, "vllm:num_requests_running", model_name="opt") == 0
        assert await get_metric(session, sim, "vllm:num_requests_waiting", model_name="opt") == 0
        async with session.get(f"{sim.url}/sim/state") as response:
            assert (await response.json())["success_total"] == 3


async def test_streamed_tokens_are_spaced_by_token_seconds(launch: Launcher) -> None:
    sim = launch("--sim-token-seconds", "0.1")
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "slow", "max_tokens": 4, "stream": True}
        async with session.post(f"{sim.url}/v1/completions", json=body) as response:
            arrivals = []
            async for line in response.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())
    gaps = [b - a for a, b in zip(arrivals[:4], arrivals[1:4])]
    assert len(gaps) == 3 and all(gap >= 0.07 for gap in gaps), gaps


# --- process lifecycle ----------------------------------------------------------------------------


def test_crash_after_exits_abruptly_with_the_given_code(launch: Launcher) -> None:
    sim = launch("--sim-crash-after", "0.5", "--sim-crash-exit-code", "7", startup=0.0)
    assert sim.wait_exit(timeout=5.0) == 7
    assert time.monotonic() - sim.launched_at >= 0.5
    assert "simulated crash" in sim.log()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_termination_signal_exits_zero_within_a_second_even_mid_stream(
    launch: Launcher, signum: signal.Signals
) -> None:
    sim = launch("--sim-spawn-child", "--sim-token-seconds", "5")
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "long", "max_tokens": 100, "stream": True}
        async with session.post(f"{sim.url}/v1/completions", json=body) as response:
            assert (await response.content.readline()).startswith(b"data: {")
            sim.proc.send_signal(signum)
            assert sim.wait_exit(timeout=1.0) == 0
    assert "Finished server process" in sim.log()


def test_termination_during_startup_exits_zero(launch: Launcher) -> None:
    sim = launch(startup=5.0, ready=False)
    assert wait_for(lambda: "Loading model" in sim.log(), timeout=5.0)
    sim.proc.terminate()
    assert sim.wait_exit(timeout=1.0) == 0


def _child_of(sim: Sim) -> psutil.Process:
    engine = psutil.Process(sim.proc.pid)
    assert wait_for(lambda: bool(engine.children()), timeout=5.0)
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
    assert wait_for(lambda: _gone(child), timeout=3.0)


def test_clean_shutdown_also_stops_the_spawned_child(launch: Launcher) -> None:
    sim = launch("--sim-spawn-child")
    child = _child_of(sim)
    sim.proc.terminate()
    assert sim.wait_exit(timeout=1.0) == 0
    assert wait_for(lambda: _gone(child), timeout=2.0)
