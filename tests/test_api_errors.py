"""Bad input gets a 4xx with a message that says what to fix; never a 500 or a traceback."""

from __future__ import annotations

import json

import pytest

from tests.harness import AgentProcess, http_json

pytestmark = pytest.mark.integration


def post(agent: AgentProcess, path: str, raw: bytes | str) -> tuple[int, dict]:
    return http_json(agent.url + path, "POST", raw, timeout=10)


ACTIVATE = "/v1/runtime/models/activate"
CASES = [
    (ACTIVATE, "{not json", 422, "not valid JSON"),
    (ACTIVATE, "", 422, "empty"),
    (ACTIVATE, "[1, 2]", 422, "JSON object"),
    (ACTIVATE, '{"artifact_url": "hf://a/b"}', 422, "model_name: is required"),
    (ACTIVATE, '{"model_name": 12, "artifact_url": "hf://a/b"}', 422, "model_name"),
    (ACTIVATE, '{"model_name": "../etc/passwd", "artifact_url": "hf://a/b"}', 422, "model_name"),
    (ACTIVATE, '{"model_name": "a b", "artifact_url": "hf://a/b"}', 422, "model_name"),
    (ACTIVATE, '{"model_name": "' + "x" * 200 + '", "artifact_url": "hf://a/b"}', 422, "at most 128"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "engine": "tgi"}', 422, "engine"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "s3://bucket/m"}', 400, "scheme"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "port": 80}', 400, "range"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "port": "x"}', 422, "port"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "ipc_name": "a/b"}', 422,
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
     '"engine_config": {"args": {"--x": [1]}}}', 422, "engine_config.args.--x"),
    ("/v1/runtime/models/sleep", '{"model_name": "m", "level": 3}', 422, "level"),
    ("/v1/runtime/models/sleep", '{"model_name": "nope"}', 404, "not running"),
    ("/v1/runtime/models/wake", '{"model_name": "nope"}', 404, "not running"),
    ("/v1/runtime/models/deactivate", '{"model_name": "m", "mode": "drain"}', 422, "mode"),
    # Exact types and known fields only, as the sidecar's request models have them.
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "colour": "red"}', 422,
     "colour: is not a field"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "port": true}', 422, "port"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "port": 20000.0}', 422, "port"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "kv_limit_bytes": "1"}', 422,
     "kv_limit_bytes"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", '
     '"credentials": {"AIBRIX_ENGINE_ID": "x"}}', 422, "agent's own setting"),
    (ACTIVATE, '{"model_name": "m", "artifact_url": "hf://a/b", "wait_seconds": 100000}', 422,
     "wait_seconds"),
    ("/v1/runtime/models/kv-limit", '{"model_name": "m", "limit_bytes": 1.5}', 422,
     "limit_bytes"),
    ("/v1/runtime/models/sleep", '{"model_name": "m", "operation_id": "a\\u0000b"}', 422,
     "operation_id"),
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
    if status == 422:  # FastAPI's list too, as the AIBrix sidecar answers
        assert reply["detail"] and all(d["loc"][0] == "body" for d in reply["detail"])


def test_a_secret_in_a_refused_body_is_never_echoed(agent: AgentProcess) -> None:
    code, reply = post(agent, ACTIVATE, json.dumps({
        "model_name": "m", "artifact_url": "hf://a/b", "credentials": {"HF_TOKEN": 12345678}}))
    assert code == 422 and "12345678" not in json.dumps(reply)


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
    health = agent.client.health()
    assert health["status"] == "ok" and len(health["boot_id"]) == 16


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
