"""Bad input gets a 4xx with a message that says what to fix; never a 500 or a traceback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.harness import AgentProcess

pytestmark = pytest.mark.integration


def post(agent: AgentProcess, path: str, raw: bytes | str) -> tuple[int, dict]:
    data = raw.encode() if isinstance(raw, str) else raw
    req = urllib.request.Request(agent.url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


ACTIVATE = "/v1/runtime/models/activate"
CASES = [
    (ACTIVATE, "{not json", 400, "not valid JSON"),
    (ACTIVATE, "", 400, "empty"),
    (ACTIVATE, "[1, 2]", 400, "JSON object"),
    (ACTIVATE, '{"artifact_url": "hf://a/b"}', 400, "model_name: is required"),
    (ACTIVATE, '{"model_name": 12, "artifact_url": "hf://a/b"}', 400, "model_name"),
    (ACTIVATE, '{"model_name": "../etc/passwd", "artifact_url": "hf://a/b"}', 400, "model_name"),
    (ACTIVATE, '{"model_name": "a b", "artifact_url": "hf://a/b"}', 400, "model_name"),
    (ACTIVATE, '{"model_name": "' + "x" * 200 + '", "artifact_url": "hf://a/b"}', 400, "limit"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "engine": "tgi"}', 400, "engine"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "s3://bucket/m"}', 400, "scheme"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "port": 80}', 400, "range"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "port": "x"}', 400, "port"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "ipc_name": "a/b"}', 400,
     "ipc_name"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", '
     '"engine_config": {"args": {"--port": "1"}}}', 400, "set by the runtime agent"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", '
     '"engine_config": {"args": {"--gpu-memory-utilization": "0.9"}}}', 400, "kvcached"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", '
     '"engine_config": {"args": {"--tensor-parallel-size": "two"}}}', 400, "positive whole"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", '
     '"engine_config": {"args": {"--data-parallel-size": "2"}}}', 400, "data parallel"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", '
     '"engine_config": {"args": {"max-model-len": "2"}}}', 400, "not a flag"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", '
     '"engine_config": {"args": {"--x": [1]}}}', 400, "engine_config.args.--x"),
    ("/v1/runtime/models/sleep", '{"model_name": "m", "level": 3}', 400, "level"),
    ("/v1/runtime/models/sleep", '{"model_name": "nope"}', 404, "not running"),
    ("/v1/runtime/models/wake", '{"model_name": "nope"}', 404, "not running"),
    ("/v1/runtime/models/deactivate", '{"model_name": "m", "mode": "drain"}', 400, "mode"),
]


@pytest.mark.parametrize(("path", "body", "status", "words"), CASES)
def test_bad_requests_get_a_4xx_that_says_what_to_fix(
    agent: AgentProcess, path: str, body: str, status: int, words: str
) -> None:
    code, reply = post(agent, path, body)
    assert code == status, reply
    assert reply["status"] == "error"
    assert words in reply["message"], reply["message"]
    assert "Traceback" not in reply["message"]


def test_unknown_paths_and_methods_answer_json(agent: AgentProcess) -> None:
    code, reply = post(agent, "/v1/nothing", "{}")
    assert code == 404 and "no such endpoint" in reply["message"]
    code, reply = post(agent, "/v1/runtime/snapshot", "{}")
    assert code == 405 and reply["status"] == "error"


def test_a_clashing_ipc_name_or_port_is_a_conflict(agent: AgentProcess) -> None:
    first = agent.activate_sim("qwen3.0")
    code, reply = post(agent, ACTIVATE, json.dumps(
        {"model_name": "qwen3-0", "artifact_url": "hf://a/b", "engine": "sim"}))
    assert code == 409 and "ipc_name 'kvc_qwen3-0'" in reply["message"]
    code, reply = post(agent, ACTIVATE, json.dumps(
        {"model_name": "other", "artifact_url": "hf://a/b", "port": first["port"]}))
    assert code == 409 and "in use" in reply["message"]


def test_the_healthz_endpoint_answers_ok(agent: AgentProcess) -> None:
    assert agent.client.health() == {"status": "ok"}


def test_concurrent_activations_of_one_model_start_one_engine(agent: AgentProcess) -> None:
    import threading

    results: list[dict] = []
    threads = [threading.Thread(target=lambda: results.append(agent.activate_sim("m1")))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(results) == 6
    assert len({(r["engine_id"], r["port"]) for r in results}) == 1
    assert len(agent.client.snapshot()["models"]) == 1


def test_a_huge_body_is_refused_with_413(agent: AgentProcess) -> None:
    code, reply = post(agent, ACTIVATE, '{"model_name": "' + "x" * (2 * 1024 * 1024) + '"}')
    assert code == 413 and reply["status"] == "error"


def test_lifecycle_calls_for_an_unknown_model_say_so(agent: AgentProcess) -> None:
    code, reply = post(agent, "/v1/runtime/models/kv-limit",
                       '{"model_name": "ghost", "limit_bytes": 1024}')
    assert code == 404 and "not running" in reply["message"]
