"""Engine adapters: command lines, environments and validation for vLLM and Ollama."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from engine_http.upstream import Upstream
from engines import ollama, vllm
from engines.driver import LaunchContext
from engines.client import EngineCallError
from registry.record import EngineRecord, EngineSpec


def record(engine: str, artifact: str, args: dict[str, str] | None = None) -> EngineRecord:
    spec = EngineSpec(model_name="qwen3:0.6b", artifact_url=artifact, engine=engine,  # type: ignore[arg-type]
                      ipc_name="qwen3-0-6b", args=args or {})
    return EngineRecord(engine_id="ab" * 16, spec=spec, port=20005)


def ctx(command: tuple[str, ...], simulated: bool = False) -> LaunchContext:
    return LaunchContext(command=command, simulated=simulated, bind_host="0.0.0.0",
                         base_env={"PATH": "/usr/bin", "HF_TOKEN": "t"},
                         extra_env={"AIBRIX_ENGINE_ID": "x"})


async def test_vllm_gets_agent_flags_dev_mode_and_inherits_hf_settings() -> None:
    async with Upstream(timeout=None) as http:
        driver = vllm.VllmDriver(http, "127.0.0.1", 20005, sleep_mode=True)
        argv, env = driver.command(record("vllm", "hf://Qwen/Qwen3-0.6B",
                                           {"--max-model-len": "2048"}), ctx(("vllm", "serve")))
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-0.6B"]
    assert "--enable-sleep-mode" in argv and argv[-2:] == ["--max-model-len", "2048"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_TOKEN"] == "t"
    assert env["AIBRIX_ENGINE_ID"] == "x"


async def test_vllm_without_sleep_support_starts_without_the_flag_and_says_why() -> None:
    async with Upstream(timeout=None) as http:
        driver = vllm.VllmDriver(http, "127.0.0.1", 20005, sleep_mode=False)
        argv, _ = driver.command(record("vllm", "hf://a/b"), ctx(("vllm", "serve")))
        assert "--enable-sleep-mode" not in argv
        assert "not supported on current platform" in (driver.sleep_unsupported() or "")
        assert await driver.is_sleeping(1.0) is False


async def test_ollama_runs_one_server_per_model_on_its_port_with_its_settings() -> None:
    async with Upstream(timeout=None) as http:
        driver = ollama.OllamaDriver(http, "127.0.0.1", 20005, "ollama://qwen3:0.6b")
        argv, env = driver.command(
            record("ollama", "ollama://qwen3:0.6b",
                   {"--context-length": "8192", "--num-parallel": "2", "--models": "/m"}),
            ctx(("ollama", "serve")))
        await driver.close()
    assert argv == ["ollama", "serve"]
    assert env["OLLAMA_HOST"] == "0.0.0.0:20005" and env["OLLAMA_KEEP_ALIVE"] == "-1"
    assert env["OLLAMA_CONTEXT_LENGTH"] == "8192" and env["OLLAMA_NUM_PARALLEL"] == "2"
    assert env["OLLAMA_MODELS"] == "/m"


async def test_a_simulated_ollama_gets_the_simulator_in_ollama_mode() -> None:
    async with Upstream(timeout=None) as http:
        driver = ollama.OllamaDriver(http, "127.0.0.1", 20005, "qwen3:0.6b")
        argv, _ = driver.command(record("ollama", "qwen3:0.6b", {"--sim-load-seconds": "0"}),
                                  ctx(("python", "-m", "engines.sim", "serve"), simulated=True))
        await driver.close()
    assert argv == ["python", "-m", "engines.sim", "serve", "qwen3:0.6b", "--sim-mode", "ollama",
                    "--sim-load-seconds", "0"]


# ---- vLLM's lifecycle calls, against a server that records what it was asked --------------------

from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402


async def _recording_vllm() -> tuple[TestServer, list[str]]:
    seen: list[str] = []

    async def record_call(request: web.Request) -> web.Response:
        body = await request.text()
        seen.append(f"{request.method} {request.path_qs}" + (f" {body}" if body else ""))
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record_call)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, seen


async def test_a_wake_from_level_two_reloads_the_weights_before_the_kv_cache() -> None:
    server, seen = await _recording_vllm()
    try:
        async with Upstream(timeout=None) as http:
            driver = vllm.VllmDriver(http, "127.0.0.1", server.port)
            await driver.sleep(2, 5)
            await driver.wake(2, 5)
            await driver.wake(1, 5)
    finally:
        await server.close()
    assert seen == ["POST /sleep?level=2",
                    "POST /wake_up?tags=weights",
                    'POST /collective_rpc {"method": "reload_weights"}',
                    "POST /wake_up?tags=kv_cache",
                    "POST /wake_up"]


@contextlib.asynccontextmanager
async def engine_stuck_on(stuck: str) -> AsyncIterator[int]:
    """An engine API on a local port (yielded) that never answers ``stuck`` (path and query),
    and answers anything else at once."""
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        if request.path_qs == stuck:
            await release.wait()
        return web.json_response({"is_sleeping": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield server.port  # type: ignore[misc]
    finally:
        release.set()
        await server.close()


@pytest.mark.parametrize("stuck", ["/wake_up", "/wake_up?tags=weights", "/collective_rpc",
                                   "/wake_up?tags=kv_cache"])
async def test_every_step_of_a_wake_is_bounded_by_its_timeout(stuck: str) -> None:
    """An engine that never answers one step of a wake: the call fails within its timeout
    instead of waiting for ever (the owner's lifecycle bound depends on it)."""
    async with engine_stuck_on(stuck) as port, Upstream(timeout=None) as http:
        driver = vllm.VllmDriver(http, "127.0.0.1", port)
        level = 1 if stuck == "/wake_up" else 2
        with pytest.raises(EngineCallError):
            await asyncio.wait_for(driver.wake(level, 0.2), 10)


@pytest.mark.parametrize("stuck", ["/sleep?level=1", "/is_sleeping"])
async def test_a_sleep_and_the_sleep_question_are_bounded_by_their_timeout(stuck: str) -> None:
    """An engine that never answers a sleep, or whether it sleeps: the sleep fails and the
    question goes unanswered within the timeout (the owner's sleep and health probes rely on
    it), instead of waiting for ever."""
    async with engine_stuck_on(stuck) as port, Upstream(timeout=None) as http:
        driver = vllm.VllmDriver(http, "127.0.0.1", port, sleep_mode=True)
        if stuck == "/is_sleeping":
            assert await asyncio.wait_for(driver.is_sleeping(0.2), 10) is None  # unknown
        else:
            with pytest.raises(EngineCallError):
                await asyncio.wait_for(driver.sleep(1, 0.2), 10)


async def test_the_vllm_command_line_uses_only_vllms_own_flags() -> None:
    from contract.flags import known_flags
    from contract.flags import unrecognized

    async with Upstream(timeout=None) as http:
        driver = vllm.VllmDriver(http, "127.0.0.1", 20005, sleep_mode=True)
        argv, _ = driver.command(record("vllm", "hf://Qwen/Qwen3-0.6B", {
            "--max-model-len": "2048", "--enable-lora": "", "-tp": "1"}), ctx(("vllm", "serve")))
    assert unrecognized(argv[2:], known_flags("vllm")) == []  # after "vllm serve"; MODEL is the one positional
    assert unrecognized(argv[2:] + ["--no-such-flag"], known_flags("vllm")) == ["--no-such-flag"]


async def test_an_engine_answer_nested_past_the_bound_or_over_the_size_is_no_answer() -> None:
    """A hostile engine's deep JSON was a RecursionError inside the agent, and an endless body
    was held in memory: both are now 'no answer', as a refused connection is."""
    from engines import client as engine_client

    async def deep(request: web.Request) -> web.Response:
        return web.Response(text="[" * 100_000 + "]" * 100_000, content_type="application/json")

    async def huge(request: web.Request) -> web.Response:
        return web.Response(body=b" " * (engine_client.MAX_ANSWER + 10),
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/is_sleeping", deep)
    app.router.add_get("/v1/models", huge)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with Upstream(timeout=None) as http:
            c = engine_client.EngineClient(http, "127.0.0.1", port)
            assert await c.is_sleeping(5) is None
            assert await c.served_models(5) is None
    finally:
        await runner.cleanup()
