"""The AIBrix wire, decoded as its Go controller decodes it, in every phase and on every route.

Each answer is checked twice: by Go's own ``encoding/json`` into structs written from the field
table (``tests/wire/aibrix_decode.go``, built with the Go toolchain), and by a strict Python
decoder that sees number literals as written (``tests/wire/strict.py``). A ``0.0`` where an
integer belongs fails both; JSON Schema alone would let it through. Then the controller's own
requests are replayed byte for byte and the answers its decisions depend on are checked.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import AgentProcess
from tests.wire import strict

pytestmark = pytest.mark.integration
WIRE = Path(__file__).resolve().parent / "wire"
KINDS = ("activate", "operation", "models", "snapshot")


@pytest.fixture(scope="module")
def go_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """The Go decoder, built once. Without Go it is skipped here, but never in CI."""
    go = shutil.which("go")
    if go is None:
        if os.environ.get("RUNTIME_AGENT_REQUIRE_GO"):
            pytest.fail("the Go toolchain is required (RUNTIME_AGENT_REQUIRE_GO is set)")
        return None
    out = tmp_path_factory.mktemp("go") / "aibrix_decode"
    env = {**os.environ, "GOCACHE": str(out.parent / "cache"), "GOFLAGS": "-mod=mod",
           "GO111MODULE": "off", "CGO_ENABLED": "0"}
    subprocess.run([go, "build", "-o", str(out), str(WIRE / "aibrix_decode.go")], check=True,
                   env=env, timeout=300, capture_output=True)
    return out


class Wire:
    """Decodes every answer it is given with both decoders, and remembers what it saw."""

    def __init__(self, go: Path | None) -> None:
        self.go = go
        self.phases: set[str] = set()
        self.kinds: set[str] = set()

    def decode(self, kind: str, raw: bytes) -> Any:
        body = strict.check(kind, raw)
        if self.go is not None:
            done = subprocess.run([str(self.go), kind], input=raw, capture_output=True,
                                  timeout=30)
            assert done.returncode == 0, f"Go could not decode {kind}: {done.stdout!r}"
        self.kinds.add(kind)
        if kind == "snapshot":
            self.phases |= {m["phase"] for m in body["models"]}
        return body


def raw_call(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def go_json(obj: dict[str, Any]) -> bytes:
    """A request as Go's json.Marshal writes the controller's struct: fields in order, no
    spaces; the caller leaves out what ``omitempty`` drops."""
    return json.dumps(obj, separators=(",", ":")).encode()


@pytest.fixture
def wire(go_decoder: Path | None) -> Iterator[Wire]:
    yield Wire(go_decoder)


def test_a_fraction_in_an_integer_field_fails_both_decoders(wire: Wire) -> None:
    good = go_json({"status": "success", "model_name": "m", "port": 20000, "ipc_name": "kvc_m"})
    wire.decode("activate", good)
    bad = good.replace(b"20000", b"20000.0")
    with pytest.raises(strict.WireError, match="fraction"):
        strict.check("activate", bad)
    if wire.go is not None:
        done = subprocess.run([str(wire.go), "activate"], input=bad, capture_output=True)
        assert done.returncode == 1 and b"cannot unmarshal number 20000.0" in done.stdout


def snapshot(agent: AgentProcess, wire: Wire) -> dict[str, Any]:
    code, raw = raw_call(agent.url + "/v1/runtime/snapshot")
    assert code == 200
    return dict(wire.decode("snapshot", raw))


def model(snap: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in snap["models"] if m["model_name"] == name)


def test_every_route_decodes_in_every_phase(agent_factory, wire: Wire) -> None:
    agent: AgentProcess = agent_factory(restart_delays="30")
    fail_fast: AgentProcess = agent_factory(restart_delays="")

    def start(a: AgentProcess, name: str, *flags: str) -> dict[str, Any]:
        args = {"--sim-startup-seconds": "0.05"}
        args.update(dict(f.split("=", 1) for f in flags))
        body = {"model_name": name, "artifact_url": f"hf://test/{name}", "engine": "vllm",
                "engine_config": {"args": args}}
        code, raw = raw_call(a.url + "/v1/runtime/models/activate", "POST", go_json(body))
        assert code == 200, raw
        return dict(wire.decode("activate", raw))

    start(agent, "active")
    start(agent, "asleep")
    start(agent, "crashing")
    start(agent, "stopping", "--sim-stop-seconds=2")
    start(fail_fast, "failing", "--sim-crash-after=0.3")
    for name in ("active", "asleep", "crashing", "stopping"):
        agent.wait_phase(name, "active")
    start(agent, "booting", "--sim-startup-seconds=120")  # last: it holds the card's start turn
    code, raw = raw_call(agent.url + "/v1/runtime/models/sleep", "POST", go_json(
        {"model_name": "asleep", "level": 1, "operation_id": "s1"}))
    assert code == 200 and wire.decode("operation", raw)["applied"] is True
    # the pid once active: under load an activation can answer before the engine has one
    os.kill(agent.model(agent.client.snapshot(), "crashing")["pid"], signal.SIGKILL)
    agent.wait_phase("crashing", "restarting")
    fail_fast.wait_phase("failing", "failed", timeout_s=30)
    snapshot(fail_fast, wire)
    stopper = threading.Thread(target=raw_call, args=(
        agent.url + "/v1/runtime/models/deactivate", "POST",
        go_json({"model_name": "stopping", "mode": "stop"})))
    stopper.start()
    agent.wait_phase("stopping", "stopping")
    snap = snapshot(agent, wire)
    stopper.join(30)
    code, raw = raw_call(agent.url + "/v1/runtime/models")
    assert code == 200
    listed = wire.decode("models", raw)["models"]
    assert {m["phase"] for m in listed} >= {"booting", "active", "sleeping", "restarting"}
    for op in ({"model_name": "active", "limit_bytes": 1 << 30, "operation_id": "k1"},):
        code, raw = raw_call(agent.url + "/v1/runtime/models/kv-limit", "POST", go_json(op))
        assert code == 200 and wire.decode("operation", raw)["status"] == "success"
    assert wire.phases >= {"booting", "active", "sleeping", "restarting", "failed", "stopping"}
    assert wire.kinds == set(KINDS)
    assert model(snap, "crashing")["restart_count"] == 1  # a scheduled restart counts


def test_the_controllers_own_requests_get_the_answers_its_decisions_need(
        agent: AgentProcess, wire: Wire) -> None:
    base = agent.url + "/v1/runtime/models"
    # ActivateRequest as the controller marshals it: port 0 and ipc_name "" are omitempty.
    body = go_json({"model_name": "qwen3-0.6b", "artifact_url": "hf://test/qwen3-0.6b",
                    "engine": "vllm", "ipc_name": "kvc_qwen3-0.6b",
                    "engine_config": {"args": {"--sim-startup-seconds": "0.05"}},
                    "claim_ref": {"namespace": "default", "name": "qwen3-0-6b", "uid": "u-1"}})
    code, raw = raw_call(base + "/activate", "POST", body)
    activated = wire.decode("activate", raw)
    assert code == 200 and activated["status"] == "success"
    assert activated["ipc_name"] == "kvc_qwen3-0-6b"  # sanitised as kvcached does, not refused
    agent.wait_phase("qwen3-0.6b", "active")
    # Routability: ready with the port it was given.
    code, raw = raw_call(base)
    info = wire.decode("models", raw)["models"][0]
    assert info["ready"] is True and info["port"] == activated["port"] > 0
    # The pool policy's metrics check: counters read, success total present.
    port = activated["port"]
    raw_call(f"http://127.0.0.1:{port}/v1/completions", "POST",
             go_json({"model": "qwen3-0.6b", "prompt": "hi", "max_tokens": 2}))
    snap = agent.wait_for(lambda s: model(s, "qwen3-0.6b")["request_success_total"] == 1,
                          poll_s=0.1, what="counters read")
    snap = snapshot(agent, wire)
    entry = model(snap, "qwen3-0.6b")
    assert entry["request_metrics_observed"] is True and entry["alive"] is True
    assert entry["claim_ref"] == {"namespace": "default", "name": "qwen3-0-6b", "uid": "u-1"}
    # Placement: one accelerator with whole-byte figures, the engine's KV as the engine obeys.
    assert len(snap["accelerators"]) == 1 and snap["accelerators"][0]["hbm_free_bytes"] > 0
    # applied counts: a change is true, a replay or a no-op is false.
    answers = []
    for path, op in (("/kv-limit", {"model_name": "qwen3-0.6b", "limit_bytes": 1 << 30,
                                    "operation_id": "kv-a"}),
                     ("/kv-limit", {"model_name": "qwen3-0.6b", "limit_bytes": 1 << 30,
                                    "operation_id": "kv-a"}),
                     ("/sleep", {"model_name": "qwen3-0.6b", "level": 1, "operation_id": "s-a"}),
                     ("/sleep", {"model_name": "qwen3-0.6b", "level": 1, "operation_id": "s-b"}),
                     ("/wake", {"model_name": "qwen3-0.6b", "operation_id": "w-a"}),
                     ("/wake", {"model_name": "qwen3-0.6b", "operation_id": "w-a"})):
        code, raw = raw_call(base + path, "POST", go_json(op))
        assert code == 200, raw
        answers.append(wire.decode("operation", raw)["applied"])
    assert answers == [True, False, True, False, True, False]
    snap = snapshot(agent, wire)
    assert model(snap, "qwen3-0.6b")["kv_capacity_bytes"] == 1 << 30
    code, _ = raw_call(base + "/deactivate", "POST",
                       go_json({"model_name": "qwen3-0.6b", "mode": "stop"}))
    assert code == 200
