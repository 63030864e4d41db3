"""The simulated engine in Ollama mode, run as a real process, behaves like one `ollama serve`.

Every test starts `python -m engines.sim serve --sim-mode ollama` in its own session on a free port
and kills the whole process group afterwards, so no server outlives its test.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engines.sim.ollama_config import (
    FOREVER,
    keep_alive_from_env,
    keep_alive_from_json,
    normalize_model_name,
    parse_go_duration,
    parse_host,
    settings_from_env,
)
from contract.quantity import GiB as GIB, MiB as MIB
from engines.sim.options import OptionsError, parse_options

pytestmark = pytest.mark.timeout(30)

from tests.harness import SimProcess, engine_port, port_is_open

REPO_ROOT = Path(__file__).resolve().parents[1]
KIB = 1024





Ollama = SimProcess  # one running simulated `ollama serve`


Launcher = Callable[..., Ollama]


def _launch(tmp_dir: Path, servers: list[Ollama], *flags: str, env: dict[str, str] | None = None,
            startup: float = 0.05, ready: bool = True, host_env: str | None = None) -> Ollama:
    """Start one server (recorded for the group kill); it listens where ``OLLAMA_HOST`` says."""
    port = engine_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SIM_", "OLLAMA_"))}
    full_env["OLLAMA_HOST"] = host_env if host_env is not None else f"127.0.0.1:{port}"
    full_env["OLLAMA_MODELS"] = str(tmp_dir / "models")
    full_env.update(env or {})
    argv = [sys.executable, "-m", "engines.sim", "serve", "--sim-mode", "ollama",
            "--sim-startup-seconds", str(startup), *flags]
    log_path = tmp_dir / f"ollama-{port}.log"
    launched_at = time.monotonic()  # before Popen: the server cannot start any clock earlier than this
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=full_env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Ollama(proc, port, log_path, launched_at)
    servers.append(server)
    if ready:
        server.wait_ready()
    return server


def _kill_group(server: Ollama) -> None:
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait()


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    servers: list[Ollama] = []

    def start(*flags: str, **kwargs: Any) -> Ollama:
        return _launch(tmp_path, servers, *flags, **kwargs)

    try:
        yield start
    finally:
        for server in servers:
            _kill_group(server)


async def post_json(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as response:
        assert response.status == 200
        return await response.json()


async def ps(session: aiohttp.ClientSession, server: Ollama) -> list[dict[str, Any]]:
    models: list[dict[str, Any]] = (await get_json(session, f"{server.url}/api/ps"))["models"]
    return models


async def sim_state(session: aiohttp.ClientSession, server: Ollama) -> dict[str, Any]:
    state: dict[str, Any] = await get_json(session, f"{server.url}/sim/state")
    return state


async def async_wait_for(check: Callable[[], Any], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(interval)
    return bool(await check())


def ndjson(raw: str) -> list[dict[str, Any]]:
    assert raw.endswith("\n"), raw[-200:]
    return [json.loads(line) for line in raw.splitlines() if line]


# --- configuration ----------------------------------------------------------------------------------


def test_ollama_host_is_read_like_ollama_reads_it() -> None:
    assert parse_host(None) == ("127.0.0.1", 11434)
    assert parse_host("127.0.0.1:9000") == ("127.0.0.1", 9000)
    assert parse_host("http://10.0.0.5:9001") == ("10.0.0.5", 9001)
    assert parse_host("http://10.0.0.5") == ("10.0.0.5", 80)  # Ollama's default for an http:// URL
    assert parse_host("0.0.0.0") == ("0.0.0.0", 11434)
    assert parse_host(":9002") == ("0.0.0.0", 9002)
    assert parse_host("[::1]:9003") == ("::1", 9003)
    assert parse_host("example:notaport") == ("example", 11434)


def test_keep_alive_accepts_durations_seconds_and_negative_for_forever() -> None:
    assert keep_alive_from_env(None) == 300.0
    assert (keep_alive_from_env("30s"), keep_alive_from_env("1h30m"), keep_alive_from_env("45")) == (30, 5400, 45)
    assert keep_alive_from_env("-1") == FOREVER and keep_alive_from_env("-5m") == FOREVER
    assert keep_alive_from_env("0") == 0.0 and keep_alive_from_env("junk") == 300.0
    assert (keep_alive_from_json(0), keep_alive_from_json(2.5), keep_alive_from_json("10m")) == (0, 2.5, 600)
    assert keep_alive_from_json(-1) == FOREVER and keep_alive_from_json("-1s") == FOREVER
    with pytest.raises(ValueError, match="missing unit"):
        keep_alive_from_json("-1")  # a string must be a Go duration, as in Ollama's api.Duration
    with pytest.raises(ValueError):
        keep_alive_from_json(True)
    assert parse_go_duration("1.5h") == 5400 and parse_go_duration("250ms") == 0.25


def test_settings_come_from_the_ollama_environment_and_flags_override_the_address() -> None:
    settings = settings_from_env({"OLLAMA_CONTEXT_LENGTH": "8192", "OLLAMA_NUM_PARALLEL": "4",
                                  "OLLAMA_KEEP_ALIVE": "-1", "OLLAMA_MODELS": "/m"})
    assert (settings.context_length, settings.num_parallel, settings.keep_alive_s) == (8192, 4, math.inf)
    assert (settings.host, settings.port, settings.models_dir) == ("127.0.0.1", 11434, "/m")
    options = parse_options(["serve", "--sim-mode", "ollama", "--port", "7000", "--sim-missing-model", "a",
                             "--sim-missing-model", "b:7b"], {"OLLAMA_HOST": "0.0.0.0:1"})
    assert (options.host, options.port, options.model) == ("0.0.0.0", 7000, "")
    assert options.missing_models == ("a:latest", "b:7b") and options.kvcached_ipc_name is None
    options = parse_options(["serve"], {"SIM_MODE": "ollama", "SIM_MISSING_MODEL": "x, y:1"})
    assert options.ollama is not None and options.missing_models == ("x:latest", "y:1")
    assert (options.load_seconds, options.kv_bytes_per_token) == (0.2, 64 * KIB)
    settings = settings_from_env({"OLLAMA_NUM_PARALLEL": "many", "OLLAMA_CONTEXT_LENGTH": "0"})
    assert (settings.num_parallel, settings.context_length) == (1, 4096)  # Ollama warns and keeps defaults
    assert len(settings.warnings) == 1 and "OLLAMA_NUM_PARALLEL" in settings.warnings[0]
    with pytest.raises(OptionsError):
        parse_options(["serve", "--sim-mode", "ollama", "--sim-load-seconds", "-1"], {})


def test_model_names_are_shown_as_ollama_shows_them() -> None:
    assert normalize_model_name("llama3.2") == "llama3.2:latest"
    assert normalize_model_name("qwen3:0.6b") == "qwen3:0.6b"
    assert normalize_model_name("registry.ollama.ai/library/mistral:7b") == "mistral:7b"
    assert normalize_model_name("me/custom") == "me/custom:latest"


# --- process and plain endpoints ----------------------------------------------------------------------


def test_port_opens_on_ollama_host_only_after_the_startup_delay(launch: Launcher) -> None:
    port = engine_port()
    server = launch(startup=1.0, ready=False, host_env=f"http://127.0.0.1:{port}")
    server.port = port
    while time.monotonic() - server.launched_at < 0.7:
        is_open = port_is_open(port)
        # judged by the time after the probe, so a probe delayed past the 1 s mark cannot fail the test
        assert not (is_open and time.monotonic() - server.launched_at < 1.0)
        time.sleep(0.05)
    server.wait_ready()
    assert time.monotonic() - server.launched_at >= 1.0
    # the line follows the bind (as Ollama's does): a connect can be answered by the kernel
    # just before it is written, so it is awaited briefly
    deadline = time.monotonic() + 5.0
    while f"Listening on 127.0.0.1:{port}" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert f"Listening on 127.0.0.1:{port}" in server.log()


async def test_root_and_version_answer_like_ollama(launch: Launcher) -> None:
    server = launch()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/") as response:
            assert response.status == 200 and await response.text() == "Ollama is running"
        async with session.head(f"{server.url}/") as response:
            assert response.status == 200
        version = await get_json(session, f"{server.url}/api/version")
        assert isinstance(version["version"], str) and version["version"]
        async with session.get(f"{server.url}/api/nothing") as response:
            assert response.status == 404 and await response.text() == "404 page not found"
        assert await ps(session, server) == []


def test_sigterm_exits_zero_promptly(launch: Launcher) -> None:
    server = launch()
    server.proc.terminate()
    assert server.proc.wait(timeout=3.0) == 0


# --- loading and unloading -------------------------------------------------------------------------


async def test_load_via_generate_lists_the_model_in_ps_with_size_vram_and_context_length(
    launch: Launcher,
) -> None:
    server = launch("--sim-memory-bytes", str(GIB), "--sim-kv-bytes-per-token", str(32 * KIB),
                    env={"OLLAMA_CONTEXT_LENGTH": "2048", "OLLAMA_NUM_PARALLEL": "2"})
    async with aiohttp.ClientSession() as session:
        status, reply = await post_json(session, f"{server.url}/api/generate", {"model": "llama3.2"})
        assert status == 200
        assert reply["model"] == "llama3.2" and reply["response"] == "" and reply["done"] is True
        assert reply["done_reason"] == "load" and reply["created_at"].endswith("Z")
        [model] = await ps(session, server)
    size = GIB + 32 * KIB * 2048 * 2  # weights + KV slab for 2048 tokens x 2 slots
    assert (model["name"], model["model"]) == ("llama3.2:latest", "llama3.2:latest")
    assert (model["size"], model["size_vram"], model["context_length"]) == (size, size, 2048)
    assert model["details"]["format"] == "gguf" and len(model["digest"]) == 64
    assert model["expires_at"] > time.strftime("%Y-%m-%dT")  # an RFC 3339 time about 5 minutes away


async def test_keep_alive_zero_without_a_prompt_unloads_the_model(launch: Launcher) -> None:
    server = launch()
    async with aiohttp.ClientSession() as session:
        await post_json(session, f"{server.url}/api/generate", {"model": "qwen3:0.6b"})
        assert [m["name"] for m in await ps(session, server)] == ["qwen3:0.6b"]
        status, reply = await post_json(session, f"{server.url}/api/generate",
                                        {"model": "qwen3:0.6b", "keep_alive": 0})
        assert status == 200 and (reply["done"], reply["done_reason"], reply["response"]) == (True, "unload", "")
        assert await ps(session, server) == []
        assert (await sim_state(session, server))["memory"] == {"weights_bytes": 0, "kv_bytes": 0, "host_bytes": 0}
        status, reply = await post_json(session, f"{server.url}/api/generate",  # not loaded: still fine
                                        {"model": "qwen3:0.6b", "keep_alive": 0})
        assert status == 200 and reply["done_reason"] == "unload"


async def test_a_prompt_to_an_unloaded_model_loads_it_first(launch: Launcher) -> None:
    server = launch("--sim-load-seconds", "2")  # a window of 2 s in which the model is listed but loading
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        body = {"model": "llama3.2", "prompt": "hello there", "stream": False}
        request = asyncio.create_task(post_json(session, f"{server.url}/api/generate", body))

        async def listed_but_loading() -> bool:
            loaded = (await sim_state(session, server))["loaded"]
            return bool(loaded and loaded[0]["loading"])

        assert await async_wait_for(listed_but_loading, timeout=5.0)
        assert [m["name"] for m in await ps(session, server)] == ["llama3.2:latest"]  # listed != ready
        status, reply = await request
        assert status == 200 and time.monotonic() - started >= 2.0
        assert reply["load_duration"] >= 1.9e9 and reply["done_reason"] == "stop"
        assert not (await sim_state(session, server))["loaded"][0]["loading"]


async def test_an_idle_model_unloads_itself_when_its_keep_alive_expires(launch: Launcher) -> None:
    server = launch("--sim-load-seconds", "0", env={"OLLAMA_KEEP_ALIVE": "4"})  # whole seconds, as Ollama takes
    async with aiohttp.ClientSession() as session:

        async def listed() -> list[str]:
            return sorted(m["name"] for m in await ps(session, server))

        # Each model's idle clock starts on the server after its request was sent, so it cannot unload
        # sooner than its keep-alive after the send time taken here, however slow the machine.
        await post_json(session, f"{server.url}/api/generate", {"model": "c", "keep_alive": -1})
        sent_a = time.monotonic()
        await post_json(session, f"{server.url}/api/generate", {"model": "a"})
        sent_b = time.monotonic()
        await post_json(session, f"{server.url}/api/generate", {"model": "b", "keep_alive": "1500ms"})
        assert await listed() == ["a:latest", "b:latest", "c:latest"]

        async def b_gone() -> bool:
            return "b:latest" not in await listed()

        assert await async_wait_for(b_gone, timeout=5.0)
        assert time.monotonic() - sent_b >= 1.5
        assert await listed() == ["a:latest", "c:latest"]  # a has about 2.5 s of its 4 s left

        async def only_c_left() -> bool:
            return await listed() == ["c:latest"]

        assert await async_wait_for(only_c_left, timeout=8.0)
        assert time.monotonic() - sent_a >= 4.0  # OLLAMA_KEEP_ALIVE, not b's keep-alive
        models = await ps(session, server)
        assert [m["name"] for m in models] == ["c:latest"]
        assert models[0]["expires_at"][:4] > "2200"  # kept "forever": now + Go's maximum duration


async def test_keep_alive_zero_waits_for_running_requests_before_unloading(launch: Launcher) -> None:
    server = launch("--sim-request-seconds", "2.5")  # the unload and the check below fit in this window
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "prompt": "busy", "stream": False}
        running = asyncio.create_task(post_json(session, f"{server.url}/api/generate", body))

        async def one_running() -> bool:
            loaded = (await sim_state(session, server))["loaded"]
            return bool(loaded and loaded[0]["running"] == 1)

        assert await async_wait_for(one_running, timeout=5.0)
        status, reply = await post_json(session, f"{server.url}/api/generate", {"model": "m", "keep_alive": 0})
        assert status == 200 and reply["done_reason"] == "unload"
        assert [m["name"] for m in await ps(session, server)] == ["m:latest"]  # still serving
        status, _ = await running
        assert status == 200
        assert await ps(session, server) == []


# --- generation ---------------------------------------------------------------------------------------


async def test_generate_streams_ndjson_by_default_and_answers_once_with_stream_false(launch: Launcher) -> None:
    server = launch()
    url = f"{server.url}/api/generate"
    async with aiohttp.ClientSession() as session:
        body = {"model": "llama3.2", "prompt": "why is the sky blue", "options": {"num_predict": 5}}
        async with session.post(url, json=body) as response:
            assert response.status == 200 and response.headers["Content-Type"] == "application/x-ndjson"
            lines = ndjson(await response.text())
        status, single = await post_json(session, url, {**body, "stream": False})
        status_again, again = await post_json(session, url, {**body, "stream": False})
    assert len(lines) == 6 and all(not line["done"] for line in lines[:-1])
    final = lines[-1]
    assert final["done"] is True and final["done_reason"] == "length" and final["response"] == ""
    assert (final["eval_count"], final["prompt_eval_count"]) == (5, 5)
    assert {"total_duration", "load_duration", "eval_duration", "context"} <= final.keys()
    assert status == status_again == 200 and single["done"] is True
    assert single["response"] == "".join(line["response"] for line in lines) == again["response"]
    assert len(single["response"].split()) == 5


async def test_chat_answers_with_an_assistant_message_and_empty_messages_only_load(launch: Launcher) -> None:
    server = launch()
    url = f"{server.url}/api/chat"
    async with aiohttp.ClientSession() as session:
        status, loaded = await post_json(session, url, {"model": "llama3.2", "messages": []})
        assert status == 200 and loaded["done_reason"] == "load"
        assert loaded["message"] == {"role": "assistant", "content": ""}
        messages = [{"role": "user", "content": "hi"}]
        status, reply = await post_json(session, url, {"model": "llama3.2", "messages": messages, "stream": False})
        async with session.post(url, json={"model": "llama3.2", "messages": messages}) as response:
            lines = ndjson(await response.text())
        status_unload, unloaded = await post_json(session, url, {"model": "llama3.2", "messages": [],
                                                                 "keep_alive": 0})
        assert await ps(session, server) == []
    assert status == 200 and reply["message"]["role"] == "assistant" and reply["done_reason"] == "stop"
    assert len(reply["message"]["content"].split()) == 16
    assert "".join(line["message"]["content"] for line in lines) == reply["message"]["content"]
    assert lines[-1]["done"] is True and "context" not in lines[-1]
    assert status_unload == 200 and unloaded["done_reason"] == "unload"


async def test_a_missing_model_gets_404_model_not_found(launch: Launcher, tmp_path: Path) -> None:
    manifest = tmp_path / "models" / "manifests" / "registry.ollama.ai" / "library" / "gemma3"
    manifest.mkdir(parents=True)
    (manifest / "1b").write_text("{}")
    server = launch("--sim-missing-model", "ghost", env={"SIM_MEMORY_BYTES": str(512 * MIB)})
    async with aiohttp.ClientSession() as session:
        cases: list[tuple[str, dict[str, Any]]] = [
            ("/api/generate", {"model": "ghost"}),
            ("/api/generate", {"model": "ghost:latest", "prompt": "x"}),
            ("/api/chat", {"model": "ghost", "messages": [{"role": "user", "content": "x"}]}),
            ("/api/show", {"model": "ghost"}),
        ]
        for path, body in cases:
            status, reply = await post_json(session, f"{server.url}{path}", body)
            assert status == 404 and reply == {"error": f"model '{body['model']}' not found"}, path
        assert await ps(session, server) == []
        status, shown = await post_json(session, f"{server.url}/api/show", {"model": "gemma3:1b"})
        assert status == 200 and shown["details"]["family"] == "llama" and "completion" in shown["capabilities"]
        await post_json(session, f"{server.url}/api/generate", {"model": "other"})
        tags = (await get_json(session, f"{server.url}/api/tags"))["models"]
    assert sorted(t["name"] for t in tags) == ["gemma3:1b", "other:latest"]  # installed + loaded, never "ghost"
    assert all(t["size"] == 512 * MIB for t in tags)


async def test_bad_requests_get_400_with_an_error_document(launch: Launcher) -> None:
    server = launch()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.url}/api/generate", data=b"") as response:
            assert response.status == 400 and await response.json() == {"error": "missing request body"}
        async with session.post(f"{server.url}/api/generate", data=b"{nope") as response:
            assert response.status == 400 and "error" in await response.json()
        status, reply = await post_json(session, f"{server.url}/api/generate", {"model": "m", "keep_alive": "soon"})
        assert status == 400 and "invalid duration" in reply["error"]


async def test_num_parallel_runs_that_many_requests_at_once_and_queues_the_rest(launch: Launcher) -> None:
    server = launch("--sim-request-seconds", "2", env={"OLLAMA_NUM_PARALLEL": "2"})
    async with aiohttp.ClientSession() as session:
        await post_json(session, f"{server.url}/api/generate", {"model": "m"})
        started = time.monotonic()
        requests = [asyncio.create_task(post_json(session, f"{server.url}/api/generate",
                                                  {"model": "m", "prompt": f"p{i}", "stream": False}))
                    for i in range(4)]

        async def two_running_two_waiting() -> bool:
            state = await sim_state(session, server)
            return bool((state["running"], state["waiting"]) == (2, 2))

        assert await async_wait_for(two_running_two_waiting, timeout=5.0)  # true for most of the first 2 s round
        assert [status for status, _ in await asyncio.gather(*requests)] == [200] * 4
        assert time.monotonic() - started >= 4.0  # two rounds of 2 s
        state = await sim_state(session, server)
        assert (state["running"], state["waiting"], state["success_total"]) == (0, 0, 4)
