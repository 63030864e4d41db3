"""JSON bodies nested too deep are refused 422 before anything recurses: the rule
(``guard.jsonbody``), then the agent's API and the door as real processes (a 100,000-deep body
was a 500 ``RecursionError`` on both)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard.jsonbody import MAX_DEPTH, JsonBodyError, JsonTooDeep, loads
from tests.harness import AgentProcess, http_json

pytestmark = pytest.mark.timeout(60)
CARD = ["--simulate-gpus", "1x16GiB", "--gpu-reserve", "1GiB"]


def nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + b"1" + close * depth


def test_the_depth_bound_is_the_decoders_and_holds_for_arrays_and_objects() -> None:
    assert loads(nested(MAX_DEPTH)) is not None
    assert loads(nested(MAX_DEPTH, b'{"a":', b"}")) is not None
    for body in (nested(MAX_DEPTH + 1), nested(MAX_DEPTH + 1, b'{"a":', b"}"),
                 nested(100_000), b"[" * 1_000_000):
        with pytest.raises(JsonTooDeep, match=f"more than {MAX_DEPTH} levels"):
            loads(body)


@pytest.mark.parametrize("body", [b"{not json", b"", b"\xff", b"[1,]", b'{"a":1} x'])
def test_what_is_not_json_is_a_json_body_error_that_is_not_too_deep(body: bytes) -> None:
    with pytest.raises(JsonBodyError) as caught:
        loads(body)
    assert not isinstance(caught.value, JsonTooDeep) and str(caught.value)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text()
                    | st.floats(allow_nan=False),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
                    max_leaves=30)


@given(JSON)
def test_documents_within_the_bound_decode_as_the_standard_library_decodes_them(
        doc: object) -> None:
    body = json.dumps(doc).encode()
    assert loads(body) == json.loads(body)


# ---- real processes -----------------------------------------------------------------------


@pytest.mark.integration
def test_the_agent_api_and_the_door_answer_a_deep_body_422_and_log_no_traceback(
        tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    agent = agent_factory(free_ports=["--claims-port", "--door-port"],
                          extra_args=[*CARD, "--claims", str(claims)])
    door_port = agent.ports["--door-port"]
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, doc = http_json(f"{agent.url}/v1/runtime/models/activate", "POST", deep)
    assert status == 422 and "more than" in doc["message"], doc
    assert doc["detail"][0]["type"] == "json_invalid"
    status, doc = http_json(f"http://127.0.0.1:{door_port}/v1/chat/completions", "POST", deep)
    assert status == 422 and doc["error"]["code"] == "json_too_deep", doc
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    status, doc = http_json(f"http://127.0.0.1:{door_port}/v1/chat/completions", "POST",
                            b"{not json")
    assert status == 400 and "not valid JSON" in doc["error"]["message"]
    assert agent.client.health() is not None  # and the agent goes on serving
    assert "Traceback" not in agent.log_tail(400) and "RecursionError" not in agent.log_tail(400)
