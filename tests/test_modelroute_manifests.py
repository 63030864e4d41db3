"""ModelRoute manifests in the claims directory: taken when valid, a problem saying what to fix
when not, and never one that hides a claim's own model name."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.local.desired import DesiredState
from tests.reconciler_fakes import claim_yaml

pytestmark = pytest.mark.timeout(30)


def route(name: str, spec: str = "require: {matchLabels: {family: qwen}}") -> str:
    return (f"---\napiVersion: model.aibrix.ai/v1alpha1\nkind: ModelRoute\n"
            f"metadata: {{name: {name}}}\nspec:\n  {spec}\n")


def desired(tmp_path: Path, text: str) -> DesiredState:
    (tmp_path / "all.yaml").write_text(text)
    state = DesiredState(tmp_path)
    state.load()
    return state


def test_a_valid_route_in_the_claims_directory_is_taken(tmp_path: Path) -> None:
    state = desired(tmp_path, route("chat", "tolerance: 0") + claim_yaml("m"))
    assert list(state.routes) == ["chat"]
    assert state.routes["chat"].tolerance == 0.0
    assert not state.problems
    assert list(state.claims) == [("default", "m")]  # claims are read as before


def test_an_invalid_route_is_a_problem_that_names_the_field_to_fix(tmp_path: Path) -> None:
    state = desired(tmp_path, route("bad", 'qualityBias: {default: "high"}'))
    assert state.routes == {}
    [problem] = state.problems
    assert (problem.kind, problem.name, problem.reason) == ("ModelRoute", "bad", "InvalidRoute")
    assert "spec.qualityBias" in problem.message and "from 0 to 1" in problem.message
    assert problem.source.endswith("all.yaml#line2")  # after the "---"


def test_a_route_named_like_a_claims_model_is_refused_and_the_claim_keeps_its_name(
        tmp_path: Path) -> None:
    state = desired(tmp_path, claim_yaml("m") + route("m") + route("chat") + route("chat"))
    assert list(state.routes) == ["chat"]
    reasons = sorted((p.name, p.reason, p.message) for p in state.problems)
    assert reasons == [
        ("chat", "Duplicate", "route 'chat' is defined more than once"),
        ("m", "Duplicate", "'m' is the modelName of claim default/m; give the route another "
                           "name")]
    assert state.by_model("m") == ("default", "m")
