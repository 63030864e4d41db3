"""One access rule on all three servers, tried as a stranger would, against real processes.

One node: ``runtime-agent serve --claims DIR --token-file T --auth-reads --door-api-keys K``
(the agent's API, the embedded reconciler's API and the front door, one process, real sockets).
Every route of each server (the agent's from its OpenAPI route list, the reconciler's from its
OpenAPI document, the door's inference and model routes) is asked with every kind of wrong
credentials and every spelling of its path; open routes (``/healthz``, ``/ready``,
``/metrics``) must answer, closed ones must be the one 401 and change nothing.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.openapi import openapi_document as reconciler_document
from runtime_agent.api.openapi import ROUTES as AGENT_ROUTES
from runtime_agent.client import AgentClient
from tests.harness import AgentProcess
from tests.reconciler_fakes import claim_yaml
from tests.waits import until_blocking

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
GiB = 1 << 30
TOKEN = "node-token-0123456789"
KEY = "sk-door-key-0123456789"
SIM = {"--sim-startup-seconds": "0.1", "--sim-memory-bytes": str(GiB),
       "--sim-kv-capacity-bytes": str(8 * GiB)}


@dataclass
class Node:
    agent: AgentProcess
    claims_port: int
    door_port: int

    def port(self, server: str) -> int:
        return {"agent": self.agent.port, "reconciler": self.claims_port,
                "door": self.door_port}[server]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    where = Path(tmp_path_factory.mktemp("access"))
    (where / "claims").mkdir()
    (where / "claims" / "m.yaml").write_text(claim_yaml("m", "m", "3Gi", "1Gi", SIM))
    (where / "token").write_text(TOKEN + "\n")
    (where / "keys").write_text(KEY + "\n")
    agent = AgentProcess(where / "state", engine_host=None, free_ports=[
        "--claims-port", "--door-port"], extra_args=[
        "--simulate-gpus", "1x16GiB", "--claims", str(where / "claims"),
        "--token-file", str(where / "token"), "--auth-reads",
        "--door-api-keys", str(where / "keys"), "--door-access-log", "off"])
    agent.client = AgentClient(agent.url, timeout_s=60, token=TOKEN)
    try:
        agent.start()
        agent.wait_phase("m", "active", timeout_s=60)
        yield Node(agent, agent.ports["--claims-port"], agent.ports["--door-port"])
    finally:
        agent.cleanup()


def ask(port: int, method: str, path: str, authorization: tuple[str, ...] = (),
        body: bytes | None = None) -> tuple[int, dict[str, Any] | None, http.client.HTTPMessage]:
    """One request with ``path`` sent exactly as given and each ``Authorization`` value as a
    header of its own."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for value in authorization:
            conn.putheader("Authorization", value)
        if method == "POST":
            body = b"{}" if body is None else body
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            doc = None
        return resp.status, doc if isinstance(doc, dict) else None, resp.headers
    finally:
        conn.close()


def reconciler_wake(node: Node, *authorization: str) -> tuple[int, dict[str, Any] | None]:
    status, doc, _ = ask(node.claims_port, "POST", "/v1/routes/m/wake", authorization)
    return status, doc


def route_of(node: Node, model: str) -> dict[str, Any]:
    status, doc, _ = ask(node.claims_port, "GET", "/v1/routes", (f"Bearer {TOKEN}",))
    assert status == 200 and doc is not None
    return next(r for r in doc["routes"] if r["model"] == model)


def test_the_reconcilers_wake_without_the_token_is_401_and_the_model_stays_asleep(
        node: Node) -> None:
    agent = node.agent
    agent.client.sleep("m")
    agent.wait_phase("m", "sleeping")
    until_blocking("the route to say sleeping",
                   lambda: route_of(node, "m")["state"] == "sleeping")
    for stranger in ((), ("Bearer not-the-token-000",), (f"Basic {TOKEN}",)):
        status, doc = reconciler_wake(node, *stranger)
        assert status == 401 and doc is not None and doc["status"] == "error"
        assert TOKEN not in json.dumps(doc)
    assert route_of(node, "m")["wakeRequested"] is False  # nothing was recorded
    assert agent.model(agent.client.snapshot(), "m")["phase"] == "sleeping"
    status, doc = reconciler_wake(node, f"Bearer {TOKEN}")
    assert status == 202 and doc is not None and doc["status"] == "accepted"
    agent.wait_phase("m", "active", timeout_s=60)


# ---- every route x every wrong credential x every spelling of the path ----------------------


def _filled(path: str) -> str:
    return re.sub(r"{[^}]+}", "m", path)


OPEN = {"agent": {"/healthz", "/ready", "/metrics"}, "reconciler": {"/healthz", "/metrics"},
        "door": {"/healthz"}}
ROUTES: dict[str, list[tuple[str, str]]] = {
    "agent": [(r.method.upper(), _filled(r.path)) for r in AGENT_ROUTES]
    + [("GET", "/openapi.json")],
    "reconciler": [(method.upper(), _filled(path))
                   for path, ops in reconciler_document()["paths"].items() for method in ops],
    "door": [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
             ("POST", "/v1/embeddings"), ("GET", "/v1/models"), ("GET", "/v1/models/m"),
             ("GET", "/healthz")],
}
CLOSED = [(server, method, path) for server, routes in ROUTES.items()
          for method, path in routes if path not in OPEN[server]]
OPENED = [(server, method, path) for server, routes in ROUTES.items()
          for method, path in routes if path in OPEN[server]]


def wrong_credentials(secret: str) -> list[tuple[str, ...]]:
    basic = base64.b64encode(f"user:{secret}".encode()).decode()
    return [(), ("Bearer not-the-token-000",), (f"Basic {basic}",), (f"Basic {secret}",),
            (secret,), (f"Token {secret}",), ("Bearer",), ("Bearer    ",),
            (f"Bearer {secret.upper()}",), (f"Bearer {secret}x",), (f"Bearer {secret[:-1]}",),
            (f"Bearer {secret} {secret}",), (f"Bearer {secret}, Bearer {secret}",),
            (f"Bearer {secret}", f"Bearer {secret}"), (f"Bearer x{secret}",)]


def _encode_one(path: str, at: int) -> str:
    letters = [i for i, c in enumerate(path) if c.isalnum()]
    i = letters[at % len(letters)]
    return f"{path[:i]}%{ord(path[i]):02X}{path[i + 1:]}"


TRICKS: list[Callable[[str, int], str]] = [
    lambda p, _: p, lambda p, _: "/" + p, lambda p, _: "/healthz/.." + p,
    lambda p, _: "/healthz/%2e%2e" + p, lambda p, _: "/metrics/../.." + p, lambda p, _: p + "/",
    _encode_one, lambda p, _: p.replace("/", "%2F", 2).replace("%2F", "/", 1),
    lambda p, _: "/." + p, lambda p, _: p + "?auth=" + TOKEN[:4], lambda p, _: p.upper(),
    lambda p, _: p + "/.", lambda p, _: p + "%00"]


def secret_of(server: str) -> str:
    return KEY if server == "door" else TOKEN


def assert_the_one_401(server: str, status: int, doc: dict[str, Any] | None,
                       headers: http.client.HTTPMessage) -> None:
    assert status == 401, status
    assert doc is not None and (headers.get("WWW-Authenticate") or "").startswith("Bearer")
    if server == "door":  # OpenAI's error shape
        assert doc["error"]["code"] == "invalid_api_key"
    else:
        assert doc["status"] == "error" and doc["message"]
    assert TOKEN not in json.dumps(doc) and KEY not in json.dumps(doc)


@given(route=st.sampled_from(CLOSED), trick=st.sampled_from(TRICKS),
       at=st.integers(0, 50), which=st.integers(0, 100))
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_closed_route_is_the_one_401_to_any_wrong_credentials_and_any_spelling(
        node: Node, route: tuple[str, str, str], trick: Callable[[str, int], str], at: int,
        which: int) -> None:
    server, method, path = route
    credentials = wrong_credentials(secret_of(server))
    asked = trick(path, at)
    status, doc, headers = ask(node.port(server), method, asked,
                               credentials[which % len(credentials)])
    if server == "door" and status != 401:
        # the door matches paths exactly: another spelling is no route of its (404), or not
        # HTTP it takes (400); either way nothing was served
        assert status in (400, 404), (asked, status, doc)
        return
    if status == 405:
        # the spelling is another route's path (POST /v1/model/download%00 is DELETE
        # /v1/model/{artifact_id}'s): a 405 that names the methods it takes runs nothing
        allow = {m.strip() for m in (headers.get("Allow") or "").split(",")}
        assert allow and method not in allow, (asked, allow)
        return
    assert_the_one_401(server, status, doc, headers)


@pytest.mark.parametrize("route", OPENED, ids=[f"{s}{p}" for s, _, p in OPENED])
def test_an_open_route_answers_whatever_credentials_come_with_it(
        node: Node, route: tuple[str, str, str]) -> None:
    server, method, path = route
    for credentials in wrong_credentials(secret_of(server)):
        status, _, _ = ask(node.port(server), method, path, credentials)
        assert status == 200, (server, path, credentials, status)


@pytest.mark.parametrize("server, path", [("agent", "/v1/runtime/snapshot"),
                                          ("reconciler", "/v1/claims"), ("door", "/v1/models")])
def test_the_token_is_taken_however_its_scheme_is_cased_or_spaced(
        node: Node, server: str, path: str) -> None:
    secret = secret_of(server)
    for header in (f"Bearer {secret}", f"bearer {secret}", f"BEARER   {secret}  "):
        assert ask(node.port(server), "GET", path, (header,))[0] == 200, header


def test_accepted_changes_and_refusals_leave_audit_lines_without_the_token(node: Node) -> None:
    ask(node.claims_port, "POST", "/v1/routes/nope/wake", ("Bearer wrong-token-000",))
    ask(node.agent.port, "POST", "/v1/runtime/models/kv-limit", (f"Bearer {TOKEN}",),
        json.dumps({"model_name": "m", "limit_bytes": 2 * GiB}).encode())

    def audited() -> list[dict[str, Any]]:
        return [json.loads(line.split("audit ", 1)[1]) for line in
                node.agent.log_path.read_text().splitlines() if " audit: audit {" in line]

    def refused() -> list[dict[str, Any]]:  # this one, or earlier ones: a flood is capped
        return [a for a in audited() if a.get("server") == "reconciler"
                and str(a.get("path")).endswith("/wake") and a.get("result") == 401]

    def taken() -> list[dict[str, Any]]:
        return [a for a in audited() if a.get("path") == "/v1/runtime/models/kv-limit"]

    until_blocking("audit lines", lambda: bool(refused()) and bool(taken()))
    assert refused()[-1]["client"] == "127.0.0.1" and refused()[-1]["reason"] in (
        "no_token", "wrong_token", "not_bearer", "two_headers")
    line = taken()[-1]
    assert line["server"] == "agent" and line["method"] == "POST" and line["result"] == 200
    assert line["principal"].startswith("sha256:") and line["principal"] != "anonymous"
    assert TOKEN not in node.agent.log_path.read_text()


def test_a_rotated_token_file_is_taken_by_the_agent_and_its_reconciler_without_a_restart(
        tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    token = tmp_path / "token"
    token.write_text("first-token-000000\n")
    (tmp_path / "claims").mkdir()
    agent: AgentProcess = agent_factory(start=False, free_ports=["--claims-port"], extra_args=[
        "--claims", str(tmp_path / "claims"), "--no-door", "--token-file", str(token)])
    agent.start()
    claims_port = agent.ports["--claims-port"]
    body = json.dumps({"model_name": "nope"}).encode()
    assert ask(agent.port, "POST", "/v1/runtime/models/wake", ("Bearer first-token-000000",),
               body)[0] == 404  # taken: there is no such model
    token.write_text("second-token-11111\n")  # as a Secret's new version
    until_blocking("the new token", lambda: ask(agent.port, "POST", "/v1/runtime/models/wake",
                                                ("Bearer second-token-11111",), body)[0] == 404)
    assert ask(agent.port, "POST", "/v1/runtime/models/wake", ("Bearer first-token-000000",),
               body)[0] == 401
    until_blocking("the reconciler to take it", lambda: ask(
        claims_port, "POST", "/v1/routes/nope/wake", ("Bearer second-token-11111",))[0] == 404)
    assert ask(claims_port, "POST", "/v1/routes/nope/wake",
               ("Bearer first-token-000000",))[0] == 401
    token.write_text("")  # a broken version keeps the last good token, never an open API
    until_blocking("the broken version to be seen",
                   lambda: "keeping the previous --token-file" in agent.log_tail(200))
    assert ask(agent.port, "POST", "/v1/runtime/models/wake", (), body)[0] == 401
    assert ask(agent.port, "POST", "/v1/runtime/models/wake", ("Bearer second-token-11111",),
               body)[0] == 404
