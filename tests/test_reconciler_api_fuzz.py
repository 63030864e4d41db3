"""The reconciler's API fuzzed from its own OpenAPI description with schemathesis, as
``tests/test_api_fuzz.py`` fuzzes the agent's.

A real node (``runtime-agent serve --claims DIR --token-file T``: the agent, the embedded
reconciler, a claim that serves) is asked generated requests, valid and not, twice: with the
token (every answer must be a status the description names, in its schema) and without it
(the wake, and everything with ``--auth-reads``, must then be the described 401).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from prometheus_client import CollectorRegistry
from schemathesis import checks

from reconciler.openapi import openapi_document
from reconciler.server import make_app
from runtime_agent.client import AgentClient
from tests.harness import AgentProcess
from tests.reconciler_fakes import claim_yaml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
GiB = 1 << 30
TOKEN = "fuzz-token-0123456789"
schema = schemathesis.openapi.from_dict(openapi_document())
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance,
          checks.response_headers_conformance, checks.unsupported_method]


@dataclass
class Reconciler:
    url: str
    agent: AgentProcess


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reconciler]:
    where = Path(tmp_path_factory.mktemp("rfuzz"))
    (where / "claims").mkdir()
    (where / "claims" / "m.yaml").write_text(claim_yaml("m", "m", "3Gi", "1Gi", {
        "--sim-startup-seconds": "0.1", "--sim-memory-bytes": str(GiB)}))
    (where / "token").write_text(TOKEN)
    agent = AgentProcess(where / "state", engine_host=None, free_ports=["--claims-port"],
                         extra_args=["--simulate-gpus", "1x16GiB", "--claims",
                                     str(where / "claims"), "--no-door",
                                     "--token-file", str(where / "token")])
    agent.client = AgentClient(agent.url, timeout_s=60, token=TOKEN)
    try:
        agent.start()
        agent.wait_phase("m", "active", timeout_s=60)
        agent.client.sleep("m")  # a wake with something to do
        agent.wait_phase("m", "sleeping")
        yield Reconciler(f"http://127.0.0.1:{agent.ports['--claims-port']}", agent)
    finally:
        agent.cleanup()


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_holds_to_its_description_with_the_token(case: schemathesis.Case,
                                                         node: Reconciler) -> None:
    case.call_and_validate(base_url=node.url, checks=CHECKS, timeout=30,
                           headers={"Authorization": f"Bearer {TOKEN}"})


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_holds_to_its_description_without_it(case: schemathesis.Case,
                                                      node: Reconciler) -> None:
    response = case.call(base_url=node.url, timeout=30, headers={"Authorization": ""})
    case.validate_response(response, checks=CHECKS)
    if case.operation.path.endswith("/wake") and case.method.upper() == "POST":
        assert response.status_code == 401  # a wake: only with the token


def test_every_route_the_reconciler_serves_is_described() -> None:
    app = make_app(None, CollectorRegistry())  # type: ignore[arg-type]  # routes only
    served = {(route.method.lower(), re.sub(r"{(\w+)(:[^}]*)?}", r"{\1}",
                                              route.resource.canonical))
              for route in app.router.routes()
              if route.resource is not None and route.method != "HEAD"}
    described = {(method, path) for path, ops in openapi_document()["paths"].items()
                 for method in ops}
    assert served == described
