"""The simulated engine's routes a gateway needs: vLLM's /tokenize and /v1/embeddings (pooling
runner), and Ollama's OpenAI-compatible routes, each run as a real engine process."""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.harness import SimProcess, engine_port

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., SimProcess]]:
    made: list[SimProcess] = []

    def launch(*flags: str, ollama: bool = False) -> SimProcess:
        port = engine_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SIM_", "OLLAMA_"))}
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if ollama:
            env.update(OLLAMA_HOST=f"127.0.0.1:{port}", OLLAMA_MODELS=str(tmp_path / "models"))
            argv = ["serve", "--sim-mode", "ollama"]
        else:
            argv = ["serve", "t/m", "--served-model-name", "m", "--host", "127.0.0.1", "--port",
                    str(port), "--enable-sleep-mode"]
        log = tmp_path / f"sim-{port}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "engines.sim", *argv,
                                     "--sim-startup-seconds", "0.05", *flags], cwd=ROOT, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        sim = SimProcess(proc, port, log, time.monotonic())
        made.append(sim)
        sim.wait_ready()
        return sim

    yield launch
    for sim in made:
        sim.kill_group()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_tokenize_counts_a_prompt_or_rendered_messages_also_while_asleep(
        start: Callable[..., SimProcess], http: aiohttp.ClientSession) -> None:
    sim = start("--max-model-len", "64")
    status, doc = await post(http, sim.url + "/tokenize", {"model": "m", "prompt": "a b c"})
    assert status == 200 and doc["count"] == 3 == len(doc["tokens"])
    assert doc["max_model_len"] == 64 and doc["token_strs"] is None
    async with http.post(sim.url + "/sleep?level=1") as resp:
        assert resp.status == 200
    status, doc = await post(http, sim.url + "/tokenize", {
        "messages": [{"role": "user", "content": "hi there"}], "return_token_strs": True})
    assert status == 200 and doc["token_strs"] == ["user:", "hi", "there"]
    status, doc = await post(http, sim.url + "/tokenize", {"model": "x", "prompt": "a"})
    assert status == 404 and doc["error"]["type"] == "NotFoundError"


async def test_a_pooling_model_embeds_and_refuses_completions(
        start: Callable[..., SimProcess], http: aiohttp.ClientSession) -> None:
    sim = start("--runner", "pooling", "--max-model-len", "8", "--sim-embedding-dim", "16")
    status, doc = await post(http, sim.url + "/v1/embeddings",
                             {"model": "m", "input": ["one text", "one text", "other"]})
    assert status == 200 and doc["object"] == "list" and doc["id"].startswith("embd-")
    vectors = [d["embedding"] for d in doc["data"]]
    assert [len(v) for v in vectors] == [16, 16, 16] and vectors[0] == vectors[1] != vectors[2]
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-9  # unit length
    assert doc["usage"] == {"prompt_tokens": 5, "total_tokens": 5, "completion_tokens": 0,
                            "prompt_tokens_details": None}
    status, packed = await post(http, sim.url + "/v1/embeddings",
                                {"input": "one text", "encoding_format": "base64"})
    floats = struct.unpack("<16f", base64.b64decode(packed["data"][0]["embedding"]))
    assert max(abs(a - b) for a, b in zip(floats, vectors[0], strict=True)) < 1e-6
    status, doc = await post(http, sim.url + "/v1/embeddings", {"input": " ".join("w" * 9)})
    assert status == 400 and "maximum context length is 8 tokens" in doc["message"]
    status, doc = await post(http, sim.url + "/v1/completions", {"prompt": "x"})
    assert status == 400 and doc["message"] == "The model does not support Completions API"


async def test_a_generative_model_refuses_embeddings(start: Callable[..., SimProcess],
                                                     http: aiohttp.ClientSession) -> None:
    sim = start()
    status, doc = await post(http, sim.url + "/v1/embeddings", {"input": "x"})
    assert status == 400 and doc["message"] == "The model does not support Embeddings API"


async def test_ollamas_openai_routes_answer_in_its_shapes(start: Callable[..., SimProcess],
                                                          http: aiohttp.ClientSession) -> None:
    sim = start(ollama=True)
    status, doc = await post(http, sim.url + "/v1/chat/completions", {
        "model": "qwen3:0.6b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert status == 200 and doc["object"] == "chat.completion"
    assert doc["system_fingerprint"] == "fp_ollama" and doc["id"].startswith("chatcmpl-")
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    async with http.post(sim.url + "/v1/completions", json={
            "model": "qwen3:0.6b", "prompt": "hi", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        assert resp.content_type == "text/event-stream"
        raw = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    status, doc = await post(http, sim.url + "/v1/embeddings", {"model": "qwen3:0.6b",
                                                               "input": ["a", "b"]})
    assert status == 200 and [d["index"] for d in doc["data"]] == [0, 1]
    async with http.get(sim.url + "/v1/models") as resp:
        listed = (await resp.json())["data"]
    assert [(m["id"], m["owned_by"]) for m in listed] == [("qwen3:0.6b", "library")]
    status, doc = await post(http, sim.url + "/v1/chat/completions",
                             {"model": "qwen3:0.6b", "messages": []})
    assert status == 400 and doc["error"]["type"] == "invalid_request_error"


async def test_ollama_answers_a_missing_model_with_an_openai_404(
        start: Callable[..., SimProcess], http: aiohttp.ClientSession) -> None:
    sim = start("--sim-missing-model", "nope:1b", ollama=True)
    status, doc = await post(http, sim.url + "/v1/chat/completions", {
        "model": "nope:1b", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and doc["error"] == {"message": "model 'nope:1b' not found",
                                              "type": "not_found_error", "param": None,
                                              "code": None}
