"""The agent's API fuzzed from its own OpenAPI description with schemathesis.

Every operation in ``/openapi.json`` gets generated requests, valid and not; each answer must be
no server error, carry a status the description names, match the described schema, and refuse
what the description rules out. Not checked: that every schema-valid request succeeds, since
what exists on this node (a model, a LoRA-enabled engine, a local path, a free port, room on a
card) is no part of a schema; such a refusal is a 400/404/409 that says why.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from runtime_agent.api.app import make_app
from runtime_agent.api.openapi import openapi_document
from tests.harness import AgentProcess

pytestmark = pytest.mark.integration
# the events stream never ends by design: tests/test_events.py reads it
schema = schemathesis.openapi.from_dict(openapi_document()).exclude(
    path="/v1/runtime/events/stream")


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    where = Path(tmp_path_factory.mktemp("fuzz"))
    (where / "models").mkdir()  # the weight cache on, with a local root and a Hub far away
    agent = AgentProcess(where / "state", extra_args=(
        "--weight-cache-dir", str(where / "cache"), "--artifact-reserve", "0",
        "--artifact-local-root", str(where / "models")),
        env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": ""})
    agent.start()
    try:
        agent.activate_sim("m1")  # something to sleep, wake and limit
        agent.wait_phase("m1", "active")
        yield agent
    finally:
        agent.cleanup()


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_holds_to_its_description(case: schemathesis.Case, fuzzed: AgentProcess) -> None:
    if case.query and "wait" in case.query:  # a long-poll waits up to 60 s: keep it short
        case.query["wait"] = min(int(case.query["wait"]), 1) if str(case.query["wait"]).isdigit() \
            else case.query["wait"]
    case.call_and_validate(base_url=fuzzed.url, checks=CHECKS, timeout=30)


CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance,
          checks.response_headers_conformance, checks.negative_data_rejection,
          checks.unsupported_method]


def test_every_route_the_agent_serves_is_described() -> None:
    agent = SimpleNamespace(events=None, waiters=None, streams=None)
    served = {(route.method.lower(), re.sub(r"{(\w+)(:[^}]*)?}", r"{\1}",
                                              route.resource.canonical))
              for route in make_app(agent).router.routes()
              if route.resource is not None and route.method != "HEAD"}
    described = {(method, path) for path, ops in openapi_document()["paths"].items()
                 for method in ops}
    assert served - {("get", "/openapi.json")} == described
