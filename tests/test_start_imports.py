"""A plain ``serve`` imports only what it runs (issue 26): start-up time and RSS are imports.

The real agent runs with ``PYTHONPROFILEIMPORTTIME=1`` (``-X importtime``): every module it
imports, at any moment until it stops, is one line on its stderr. Without ``--claims`` it runs
no reconciler and no front door, without ``--weight-cache-dir`` no weight cache (nor its S3
or Hub client), and it
never runs the live view or a client command: none of those may be imported, nor the
OpenAPI document's models until someone asks for ``/openapi.json``. Nor are pydantic's
models built before they are needed: the request models load with the first request body,
the engine record with the first engine (pydantic's model machinery is about a third of the
agent's own import time and several MiB).
"""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import AgentProcess, http_json

ROOT = Path(__file__).resolve().parent.parent

# Packages a plain serve does not run (their names as imported).
NOT_RUN = ("boto3", "botocore", "s3transfer", "huggingface_hub", "kubernetes_asyncio",
           "kubernetes", "textual", "rich", "yaml", "ollama", "runtime_agent.console",
           "runtime_agent.api.openapi", "runtime_agent.api.schemas",
           "pydantic._internal._model_construction", "runtime_agent.api.models",
           "registry.record", "runtime_agent.artifacts.cache", "runtime_agent.artifacts.staging",
           "difflib")
# Of the reconciler, serve reads only its own flags (``reconciler.options``).
RECONCILER_READ = {"reconciler", "reconciler.options", "reconciler.door",
                   "reconciler.door.settings"}
IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)\s*$")


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    a = AgentProcess(tmp_path / "state", env={"PYTHONPROFILEIMPORTTIME": "1"})
    try:
        yield a
    finally:
        a.cleanup()


def imported(log: Path) -> set[str]:
    return {m[1] for line in log.read_text().splitlines() if (m := IMPORTED.match(line))}


def unrun(modules: set[str]) -> set[str]:
    heavy = {m for m in modules if any(m == p or m.startswith(p + ".") for p in NOT_RUN)}
    reconciler = {m for m in modules if m.split(".")[0] == "reconciler"} - RECONCILER_READ
    return heavy | reconciler


@pytest.mark.timeout(90)
def test_a_plain_serve_imports_no_reconciler_door_console_or_cloud_client(
        agent: AgentProcess) -> None:
    agent.start(timeout_s=60)
    assert http_json(f"{agent.url}/ready")[0] == 200
    assert http_json(f"{agent.url}/v1/runtime/snapshot")[0] == 200  # the routes it serves
    with urllib.request.urlopen(f"{agent.url}/metrics", timeout=30) as metrics:
        assert metrics.status == 200 and b"aibrix" in metrics.read()
    assert agent.terminate() == 0  # the stop path imports nothing heavy either
    modules = imported(agent.log_path)
    assert "runtime_agent.agent" in modules  # the profile is there: this is the agent
    assert unrun(modules) == set()


@pytest.mark.timeout(90)
def test_the_openapi_document_is_built_when_first_asked_and_stays_the_same(
        agent: AgentProcess) -> None:
    agent.start(timeout_s=60)
    first = http_json(f"{agent.url}/openapi.json")
    again = http_json(f"{agent.url}/openapi.json")
    assert first[0] == 200 and first == again
    assert "/v1/runtime/snapshot" in first[1]["paths"]
    agent.terminate()
    assert "runtime_agent.api.openapi" in imported(agent.log_path)


@pytest.mark.timeout(90)
def test_engines_inherit_the_environment_without_the_agents_pydantic_setting(
        agent: AgentProcess) -> None:
    agent.start(timeout_s=60)
    engine = agent.activate_sim("m1")
    pid = agent.wait_phase("m1", "active")["pid"] or engine["pid"]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not any(item.startswith(b"PYDANTIC_DISABLE_PLUGINS=") for item in environ)
    assert any(item.startswith(b"PYTHONPROFILEIMPORTTIME=") for item in environ)  # the rest is


@pytest.mark.timeout(90)
def test_the_first_request_body_loads_the_models_and_is_judged_by_them(
        agent: AgentProcess) -> None:
    agent.start(timeout_s=60)
    status, body = http_json(f"{agent.url}/v1/runtime/models/activate", method="POST",
                             body={"model_name": "m1", "colour": "red"})
    assert status == 422
    assert "colour: is not a field of this request; remove it" in body["message"]
    assert any(d["type"] == "extra_forbidden" for d in body["detail"])
    agent.terminate()
    modules = imported(agent.log_path)
    assert {"runtime_agent.api.models", "registry.record"} <= modules


OURS = ("runtime_agent", "engines", "registry", "guard", "contract", "engine_http")
FIND_DATACLASSES = """\
import dataclasses, importlib, sys
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    for value in vars(module).values():
        if (isinstance(value, type) and value.__module__ == name
                and dataclasses.is_dataclass(value)):
            print(f"{name}.{value.__qualname__}")
"""


@pytest.mark.timeout(90)
def test_a_plain_serve_builds_no_dataclass(agent: AgentProcess) -> None:
    """On Python 3.11 a frozen dataclass is six ``exec()``s when its module is imported (89 of
    them were 120 ms of the agent's 190 ms own import): the value types a plain serve imports
    are msgspec Structs, whose classes are built in C. Every module of ours the real agent
    imported is imported again here and searched for dataclasses."""
    agent.start(timeout_s=60)
    assert http_json(f"{agent.url}/v1/runtime/snapshot")[0] == 200
    agent.terminate()
    ours = sorted(m for m in imported(agent.log_path) if m.split(".")[0] in OURS)
    assert "runtime_agent.supervision.messages" in ours
    found = subprocess.run([sys.executable, "-c", FIND_DATACLASSES, *ours], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert found == []
