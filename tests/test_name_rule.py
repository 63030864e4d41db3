"""One name rule with fullmatch: no name the agent or the reconciler accepts ends in a newline or
holds a control character (Python's ``$`` matches before a final newline: ``"cxa\\n"`` was once
a model, listed and exported as a metric label)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from contract.engines import adapter_name_problem
from contract.names import model_name_problem
from reconciler.model.manifests import parse_manifests
from tests.harness import AgentProcess, http_json

CONTROL = st.characters(categories=["Cc"])
# valid names ('..' is refused by its own rule, so it is not generated: "0.." once was)
NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True).filter(
    lambda n: ".." not in n)


@given(name=NAMES, bad=CONTROL, where=st.sampled_from(("end", "start", "middle")))
@example(name="0.x", bad="\n", where="end")
def test_no_name_with_a_control_character_or_a_final_newline_is_accepted(
        name: str, bad: str, where: str) -> None:
    spoiled = {"end": name + bad, "start": bad + name,
               "middle": name[:1] + bad + name[1:]}[where]
    assert model_name_problem(name) is None
    assert model_name_problem(spoiled) is not None
    assert model_name_problem(name + "\n") is not None
    assert adapter_name_problem(spoiled) is not None


def claim_text(name: str, model: str | None) -> str:
    spec: dict[str, Any] = {"podSelector": {"matchLabels": {"a": "b"}},
                            "artifactURL": "hf://org/m"}
    if model is not None:
        spec["modelName"] = model
    return json.dumps({"apiVersion": "model.aibrix.ai/v1alpha1", "kind": "ModelClaim",
                       "metadata": {"name": name}, "spec": spec})


def test_the_reconciler_refuses_a_claim_or_model_name_with_a_final_newline() -> None:
    assert parse_manifests(claim_text("cxa", None)).claims[0].model_name == "cxa"
    for name, model in (("cxa\n", None), ("cxa", "cxa\n"), ("cxa", "c\x07xa")):
        result = parse_manifests(claim_text(name, model))
        assert not result.claims and result.problems, (name, model)


@pytest.mark.integration
def test_the_agent_answers_422_to_a_model_name_with_a_final_newline(
        agent: AgentProcess) -> None:
    code, body = http_json(agent.url + "/v1/runtime/models/activate", "POST",
                           {"model_name": "x\n", "artifact_url": "hf://org/m", "engine": "sim"})
    assert code == 422, body
    code, body = http_json(agent.url + "/v1/runtime/models/activate", "POST",
                           {"model_name": "x", "artifact_url": "hf://org/m", "engine": "sim",
                            "credentials": {"HF_TOKEN\n": "t"}})
    assert code == 422, body
    assert http_json(agent.url + "/v1/models")[1]["data"] == []
