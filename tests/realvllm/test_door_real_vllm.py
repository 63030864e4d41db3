"""The front door in front of a real vLLM (CPU build) serving a small embedding model: a claim
placed by the reconciler, embeddings through the door (the first request held while vLLM
boots), and the context window counted by vLLM's own ``/tokenize``."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest

from reconciler.local.app import ReconcilerApp, Settings
from reconciler.door.settings import DoorSettings
from tests.harness import AgentProcess
from tests.reconciler_fakes import claim_yaml

MODEL = "minilm"
BOOT_TIMEOUT_S = 480.0
pytestmark = pytest.mark.timeout(900)
AGENT_ARGS = ["--engines", "vllm", "--vllm-sleep-mode", "off", "--start-stall-timeout", "600"]
ENGINE_ARGS = {"--runner": "pooling", "--dtype": "float32", "--max-model-len": "256",
               "--enforce-eager": ""}


async def test_embeddings_come_through_the_door_from_a_real_vllm(
        tmp_path: Path, model_dir: Path, engine_env: None) -> None:
    agent = AgentProcess(tmp_path / "state",
                         extra_args=[*AGENT_ARGS, "--artifact-local-root", str(model_dir)])
    app: ReconcilerApp | None = None
    try:
        agent.start(timeout_s=60)
        claims = tmp_path / "claims"
        claims.mkdir()
        (claims / "pool.yaml").write_text(
            "kind: WarmPool\nmetadata:\n  name: pool-a\n  labels: {claim.model.aibrix.ai/pool: "
            'pool-a, claim.model.aibrix.ai/enabled: "true"}\nspec:\n  agents:\n'
            f'    - {{name: agent-a, url: "{agent.url}"}}\n')
        (claims / "minilm.yaml").write_text(claim_yaml(MODEL, footprint="2Gi", args=ENGINE_ARGS,
                                                       artifact=str(model_dir)))
        app = ReconcilerApp(Settings(claims, port=0, door=DoorSettings(
            port=0, max_wait_s=BOOT_TIMEOUT_S, access_log=str(tmp_path / "access.log"))))
        await app.start()
        assert app.door is not None
        url = f"http://127.0.0.1:{app.door.port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            started = time.monotonic()
            async with http.post(url + "/v1/embeddings", json={
                    "model": MODEL, "input": "warm pools keep models close"}) as resp:
                body = await resp.json()
                assert resp.status == 200, (body, agent.log_tail())
            print(f"\nfirst embedding through the door, held while vLLM booted: "
                  f"{time.monotonic() - started:.1f} s")
            assert body["model"] == MODEL and len(body["data"][0]["embedding"]) == 384
            assert body["usage"]["prompt_tokens"] > 0

            async with http.post(url + "/v1/embeddings", json={
                    "model": MODEL, "input": ["one text", "and another one"]}) as resp:
                body = await resp.json()
                assert resp.status == 200, body
            assert [d["index"] for d in body["data"]] == [0, 1]
            assert body["data"][0]["embedding"] != body["data"][1]["embedding"]

            long_input = " ".join(["context"] * 400)  # more bytes than 256: vLLM counts it
            async with http.post(url + "/v1/embeddings", json={
                    "model": MODEL, "input": long_input}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400, error
            assert error["code"] == "context_length_exceeded" and error["param"] == "input"
            assert "maximum context length is 256 tokens" in error["message"]
            counted = int(error["message"].split("resulted in ")[1].split()[0])
            assert counted >= 400  # vLLM's tokenizer: one token per word, plus its specials

            async with http.get(url + "/v1/models") as resp:
                listed = (await resp.json())["data"]
            assert [(m["id"], m["max_model_len"], m["state"]) for m in listed] == [
                (MODEL, 256, "active")]
    finally:
        if app is not None:
            await app.stop()
        agent.cleanup()
