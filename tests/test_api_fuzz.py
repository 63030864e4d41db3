"""The agent's API fuzzed from its own OpenAPI description with schemathesis.

Every operation in ``/openapi.json`` gets generated requests, valid and not; each answer must be
no server error, carry a status the description names, match the described schema, and refuse
what the description rules out. Not checked: that every schema-valid request succeeds, since
what exists on this node (a model, a LoRA-enabled engine, a local path, a free port, room on a
card) is no part of a schema; such a refusal is a 400/404/409 that says why.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from runtime_agent.api.openapi import openapi_document
from tests.harness import AgentProcess

pytestmark = pytest.mark.integration
schema = schemathesis.openapi.from_dict(openapi_document())


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    agent = AgentProcess(Path(tmp_path_factory.mktemp("fuzz")) / "state")
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
