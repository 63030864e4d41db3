"""The door speaks what the engines speak (issue 27 item 6), end to end against a real agent's
simulated engines: vLLM's other routes by model (``/v1/responses`` through the official
``openai`` client, rerank, score, pooling, classify, tokenize, detokenize), Ollama's own API by
tag through the ``ollama`` client, the opt-in release route, and the engine routes that stay
closed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.door.ollama import native_body
from reconciler.door.proxy import usage_of
from tests.reconciler_fakes import claim_yaml
from tests.test_door_integration import CHAT, SIM, SLEEPY, Door, asleep, claim, door, metric

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
__all__ = ["door"]  # the fixture, used by name
POOLING = {"--runner": "pooling"}
TAG = "qwen3:0.6b"


def ollama_claim() -> str:
    return claim("q", engine="ollama", artifact=f"ollama://{TAG}", model="qwen3-0-6b",
                 **{"--context-length": "4096"})


def client(door: Door, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=door.url + "/v1", api_key=key, max_retries=0)


async def test_the_openai_client_calls_responses_and_a_rerank_through_the_door(
        door: Door) -> None:
    door.pool()
    await door.start()
    door.write("m", claim("m"))
    door.write("r", claim("r", **POOLING))
    await door.phase("m", "Active")
    await door.phase("r", "Active")
    async with client(door) as oai:
        answer = await oai.responses.create(model="m", input="Say hello.", max_output_tokens=4)
        assert answer.status == "completed" and answer.output_text
        assert answer.usage is not None and answer.usage.output_tokens == 4
        kinds = [event.type async for event in await oai.responses.create(
            model="m", input="Say hello.", max_output_tokens=3, stream=True)]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert kinds.count("response.output_text.delta") == 3
        raw = await oai.post("/rerank", cast_to=httpx.Response, body={
            "model": "r", "query": "ocean", "documents": ["ocean", "ladder", "pepper"],
            "top_n": 2})
        ranked = raw.json()
        assert raw.status_code == 200 and len(ranked["results"]) == 2
        assert ranked["results"][0]["index"] == 0 and ranked["model"] == "r"
    text = await door.metrics()
    assert metric(text, "aibrix:door_requests_total", model="m", endpoint="responses",
                  code="200") == 2
    assert metric(text, "aibrix:door_requests_total", model="r", endpoint="rerank",
                  code="200") == 1
    assert (metric(text, "aibrix:door_tokens_total", model="m", kind="completion") or 0) >= 4


async def test_the_engines_other_routes_pass_by_model_with_keys(door: Door,
                                                                tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-everything-1\nsk-only-model-m m\n")
    door.pool()
    await door.start(api_keys=keys)
    door.write("m", claim("m"))
    door.write("r", claim("r", **POOLING))
    await door.phase("m", "Active")
    await door.phase("r", "Active")
    every = {"Authorization": "Bearer sk-everything-1"}
    pair = {"model": "r", "text_1": "ocean", "text_2": ["ocean", "pepper"]}
    rerank = {"model": "r", "query": "ocean", "documents": ["pepper", "ocean"]}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/score", pair, "data"), ("/v1/score", pair, "data"), ("/rerank", rerank, "results"),
        ("/v1/rerank", rerank, "results"), ("/v2/rerank", rerank, "results"),
        ("/pooling", {"model": "r", "input": ["a b"]}, "data"),
        ("/classify", {"model": "r", "input": ["a b"]}, "data"),
        ("/tokenize", {"model": "m", "prompt": "ocean and ladder"}, "tokens"),
    ]
    for path, body, field in cases:
        status, answer, _ = await door.post(path, body, every)
        assert status == 200 and answer[field], (path, answer)
    ids = (await door.post("/tokenize", {"model": "m", "prompt": "ocean and"}, every))[1]
    status, answer, _ = await door.post("/detokenize", {"model": "m", "tokens": ids["tokens"]},
                                        every)
    assert status == 200 and answer["prompt"] == "ocean and"
    scores = (await door.post("/score", pair, every))[1]["data"]
    assert scores[0]["score"] > scores[1]["score"]
    status, answer, _ = await door.post("/score", pair)
    assert status == 401
    status, answer, _ = await door.post("/score", pair, {"Authorization": "Bearer sk-only-model-m"})
    assert status == 403 and answer["error"]["code"] == "model_not_allowed"
    status, answer, _ = await door.post("/v1/responses", {"model": "zzz", "input": "x"}, every)
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    text = await door.metrics()
    assert metric(text, "aibrix:door_requests_total", model="r", endpoint="score",
                  code="200") == 3


async def test_a_responses_request_for_a_sleeping_model_waits_for_one_wake(door: Door) -> None:
    door.pool(SLEEPY)
    await door.start()
    await asleep(door, "m")
    async with client(door) as oai:
        answer = await oai.responses.create(model="m", input="hi", max_output_tokens=2)
    assert answer.status == "completed" and door.wakes("m") == 1
    assert (await door.logged(1))["held_for"] == "wake"


async def test_an_ollama_claim_answers_ollamas_own_api_by_its_tag(door: Door) -> None:
    door.pool()
    await door.start()
    door.write("q", ollama_claim())
    door.write("m", claim("m"))
    await door.phase("q", "Active")
    await door.phase("m", "Active")
    async with ollama.AsyncClient(host=door.url) as tool:
        assert [m.model for m in (await tool.list()).models] == [TAG]  # the vLLM claim is not
        running = (await tool.ps()).models
        assert [m.model for m in running] == [TAG] and running[0].size_vram
        said = await tool.chat(model=TAG, messages=CHAT, stream=False)
        assert said.message.content and said.done
        pieces = [part async for part in await tool.chat(model=TAG, messages=CHAT, stream=True)]
        assert len(pieces) > 1 and pieces[-1].done
        made = await tool.generate(model=TAG, prompt="Say hello.", stream=False)
        assert made.response
        text = await door.metrics()
        assert metric(text, "aibrix:door_requests_total", model="qwen3-0-6b",
                      endpoint="ollama_chat", code="200") == 2
        assert (metric(text, "aibrix:door_tokens_total", model="qwen3-0-6b",
                       kind="prompt") or 0) > 0
        status, body, _ = await door.post("/api/chat", {"model": "m", "messages": CHAT})
        assert status == 400 and "Ollama" in body["error"]["message"]
        status, body, _ = await door.post("/v1/rerank", {"model": TAG, "query": "a",
                                                         "documents": ["b"]})
        assert status == 400 and "SGLang and vLLM engines" in body["error"]["message"]


async def test_a_client_cannot_unload_an_ollama_model_through_keep_alive(door: Door) -> None:
    door.pool()
    await door.start()
    door.write("q", ollama_claim())
    await door.phase("q", "Active")
    async with ollama.AsyncClient(host=door.url) as tool:
        await tool.chat(model=TAG, messages=[], keep_alive=0)  # Ollama: unload it now
        await tool.generate(model=TAG, prompt="", keep_alive=0)
        said = await tool.chat(model=TAG, messages=CHAT, stream=False, keep_alive="1s")
        assert said.done
        engine = door.engine("qwen3-0-6b")
        async with httpx.AsyncClient() as http:
            loaded = (await http.get(f"http://127.0.0.1:{engine['port']}/api/ps")).json()
        assert [m["model"] for m in loaded["models"]] == [TAG]
        assert int(loaded["models"][0]["expires_at"][:4]) > 2200  # still kept for ever
        assert door.status("q") is not None and door.status("q").phase == "Active"  # type: ignore


CLOSED = [("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
          ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("GET", "/metrics"),
          ("GET", "/sim/state"), ("GET", "/server_info"), ("POST", "/v1/load_lora_adapter"),
          ("POST", "/v1/unload_lora_adapter"), ("POST", "/load_lora_adapter"),
          ("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"),
          ("POST", "/flush_cache"), ("POST", "/update_weights_from_disk"),
          ("POST", "/start_profile"), ("POST", "/abort_request"), ("POST", "/api/pull"),
          ("DELETE", "/api/delete"), ("POST", "/api/create"), ("POST", "/api/copy"),
          ("POST", "/api/push"), ("POST", "/scale_elastic_ep"), ("POST", "/pause"),
          ("GET", "/v1/routes"), ("POST", "/v1/routes/m/wake"), ("POST", "/invocations"),
          ("GET", "/health"), ("GET", "/version"), ("POST", "/generate"),
          ("POST", "/v1/models/m/release")]  # off unless --door-allow-release


async def test_routes_that_manage_engines_stay_closed(door: Door) -> None:
    door.pool()
    await door.start()
    door.write("m", claim("m"))
    await door.phase("m", "Active")
    assert door.http is not None
    for method, path in CLOSED:
        async with door.http.request(method, door.url + path, json={"model": "m"}) as resp:
            assert resp.status == 404, (method, path, resp.status)
            assert (await resp.json())["error"]["code"] == "unknown_url"
    assert door.engine("m")["phase"] == "active"


async def test_a_person_at_the_door_releases_a_model_with_a_key_that_may_use_it(
        door: Door, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-everything-1\nsk-only-model-a a\n")
    door.pool()  # no idle sleep: only the release puts it to sleep
    await door.start(api_keys=keys, allow_release=True)
    door.write("a", claim("a"))
    door.write("b", claim("b"))
    door.write("q", ollama_claim())
    for name in ("a", "b", "q"):
        await door.phase(name, "Active")
    only_a = {"Authorization": "Bearer sk-only-model-a"}
    status, body, _ = await door.post("/v1/models/a/release", {})
    assert status == 401
    status, body, _ = await door.post("/v1/models/b/release", {}, only_a)
    assert status == 403 and door.status("b").phase == "Active"  # type: ignore[union-attr]
    status, body, _ = await door.post("/v1/models/a/release", {}, only_a)
    assert status == 200 and body["released"] is True and body["state"] == "sleeping", body
    assert door.status("a").phase == "Sleeping"  # type: ignore[union-attr]
    assert door.engine("a")["phase"] == "sleeping"
    status, body, _ = await door.post("/v1/models/a/release", {}, only_a)
    assert status == 200 and body["released"] is False
    every = {"Authorization": "Bearer sk-everything-1"}
    status, body, _ = await door.post("/v1/models/qwen3-0-6b/release", {}, every)
    assert status == 409 and "Only vLLM engines sleep" in body["error"]["message"]
    status, body, _ = await door.post("/v1/models/zzz/release", {}, every)
    assert status == 404
    status, body, _ = await door.post("/v1/chat/completions",
                                      {"model": "a", "messages": CHAT, "max_tokens": 2}, only_a)
    assert status == 200 and door.wakes("a") == 1  # a request wakes it as after an idle sleep


async def test_an_sglang_claim_answers_its_own_paths_through_the_door(door: Door) -> None:
    door.pool()
    await door.start()
    door.write("s", claim_yaml("s", "s", "3Gi", "1Gi", {"--context-length": "2048", **SIM},
                               engine="sglang").replace('\n      "--max-model-len": "2048",',
                                                        ""))
    await door.phase("s", "Active", timeout=60)
    status, ids, _ = await door.post("/v1/tokenize", {"model": "s", "prompt": "ocean and"})
    assert status == 200 and ids["count"] == 2, ids
    status, body, _ = await door.post("/v1/detokenize", {"model": "s", "tokens": ids["tokens"]})
    assert status == 200 and body["prompt"] == "ocean and"
    async with client(door) as oai:
        answer = await oai.responses.create(model="s", input="hi", max_output_tokens=2)
    assert answer.output_text
    status, body, _ = await door.post("/pooling", {"model": "s", "input": "a"})
    assert status == 400 and "vLLM engines" in body["error"]["message"]


def test_the_release_route_is_an_operators_flag_off_by_default() -> None:
    from reconciler.cli import door_settings
    from runtime_agent.cli import parser

    argv = ["reconcile", "--claims", "c", "--pool", "p", "--door-port", "0"]
    default = door_settings(parser().parse_args(argv), "h")
    assert default is not None and default.allow_release is False
    on = door_settings(parser().parse_args([*argv, "--door-allow-release"]), "h")
    assert on is not None and on.allow_release is True


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(doc=st.dictionaries(st.text(max_size=10), JSON, max_size=6), keep=JSON,
       tag=st.text(min_size=1, max_size=12))
def test_no_ollama_body_leaves_the_door_with_a_keep_alive(doc: dict[str, Any], keep: Any,
                                                          tag: str) -> None:
    for given_doc in (doc, {**doc, "keep_alive": keep}):
        body = json.dumps(given_doc).encode()
        sent = json.loads(native_body(given_doc, body, tag))
        assert "keep_alive" not in sent and sent["model"] == tag
        assert {k: v for k, v in sent.items() if k != "model"} == \
            {k: v for k, v in given_doc.items() if k not in ("model", "keep_alive")}


def test_usage_is_read_from_the_responses_api_and_ollamas_native_counts() -> None:
    responses = b'{"id":"resp_1","usage":{"input_tokens":7,"output_tokens":3,"total_tokens":10}}'
    assert usage_of(responses) == (7, 3)
    ndjson = (b'{"model":"q","message":{"content":"a"},"done":false}\n'
              b'{"model":"q","done":true,"prompt_eval_count":12,"prompt_eval_duration":5,'
              b'"eval_count":4,"eval_duration":9}\n')
    assert usage_of(ndjson) == (12, 4)
    assert usage_of(b'{"tokens":[1,2],"count":2}') is None
