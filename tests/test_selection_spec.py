"""A ModelRoute manifest: what it accepts, what it refuses (saying what to fix), how it scores
claims and in which order it lists its candidates."""

from __future__ import annotations

from typing import Any

import pytest

from contract.quantity import GiB
from reconciler.selection.candidates import ClaimInfo, rank
from reconciler.selection.route_spec import Route, RouteError, parse_route
from reconciler.selection.scoring import Scorer, effective_bias

pytestmark = pytest.mark.timeout(30)


def manifest(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "model.aibrix.ai/v1alpha1", "kind": "ModelRoute",
            "metadata": {"name": "chat"}, "spec": spec}


SEED_RULE = manifest(
    require={"matchLabels": {"capability/tool-calling": "true"},
             "matchExpressions": [{"key": "params", "operator": "In",
                                   "values": ["14B", "32B"]}]},
    prefer=[{"weight": 100, "selector": {"matchLabels": {"family": "qwen3", "params": "32B"}}},
            {"weight": 50, "selector": {"matchLabels": {"family": "qwen3", "params": "14B"}}}])


def qwen(params: str, footprint: int | None = None, **labels: str) -> ClaimInfo:
    return ClaimInfo(f"qwen3-{params.lower()}", {"family": "qwen3", "params": params,
                                                 "capability/tool-calling": "true", **labels},
                     footprint)


def test_the_seeds_mulling_rule_parses_into_a_hard_require_and_weighted_prefers() -> None:
    route = parse_route(SEED_RULE)
    assert route.name == "chat" and route.tolerance == 10.0
    assert [p.weight for p in route.prefer] == [100, 50]
    assert route.require.matches(qwen("14B").labels)
    assert not route.require.matches(qwen("8B").labels)


def test_the_candidates_are_what_the_require_admits_scored_by_the_prefer_weights() -> None:
    claims = [qwen("32B", 20 * GiB), qwen("14B", 9 * GiB), qwen("8B", 5 * GiB)]
    ranked = rank(parse_route(SEED_RULE), claims)
    assert [(r.name, r.score) for r in ranked] == [("qwen3-32b", 100.0), ("qwen3-14b", 50.0)]


def test_equal_scores_go_to_the_smaller_declared_footprint_then_the_name() -> None:
    route = Route("chat")
    claims = [ClaimInfo("b", {}, None), ClaimInfo("c", {}, 2 * GiB), ClaimInfo("a", {}, None),
              ClaimInfo("d", {}, 1 * GiB)]
    assert [r.name for r in rank(route, claims)] == ["d", "c", "a", "b"]


def test_the_preferred_candidate_is_the_best_one_that_fits_some_gpu() -> None:
    claims = [qwen("32B", 40 * GiB), qwen("14B", 9 * GiB)]
    ranked = rank(parse_route(SEED_RULE), claims, largest_card=32 * GiB)
    assert [r.name for r in ranked] == ["qwen3-14b", "qwen3-32b"]


@pytest.mark.parametrize(("bias", "order"), [
    ("0.7", ["high", "medium", "low"]), ("0.3", ["low", "medium", "high"])])
def test_a_quality_bias_orders_latency_classes_as_the_seed_says(bias: str, order: list[str]
                                                               ) -> None:
    route = parse_route(manifest(qualityBias={"reasoning": bias}, capabilities=["reasoning"]))
    claims = [ClaimInfo(c, {"latencyClass": c}) for c in ("low", "medium", "high")]
    ranked = rank(route, claims)
    assert [r.name for r in ranked] == order
    assert [r.score for r in ranked] == pytest.approx([70.0, 50.0, 30.0])


def test_the_effective_bias_is_the_largest_of_the_callers_capabilities_else_the_default() -> None:
    biases = {"reasoning": 0.7, "tool-calling": 0.3, "default": 0.4}
    assert effective_bias(biases, ("tool-calling", "reasoning")) == 0.7
    assert effective_bias(biases, ("kubernetes",)) == 0.4
    assert effective_bias({"reasoning": 0.7}, ("kubernetes",)) is None


def test_explicit_prefer_weights_always_win_over_the_quality_bias() -> None:
    route = parse_route(manifest(prefer=[{"weight": 5, "selector": {
        "matchLabels": {"latencyClass": "low"}}}], qualityBias={"default": "1"}))
    scorer = Scorer(route)
    assert scorer.score({"latencyClass": "low"}) == 5.0
    assert scorer.score({"latencyClass": "high"}) == 0.0


# Malformed specs and what the refusal says (tests/test_kube_manifests.py: the ModelRoute CRD
# refuses each of them too).
MALFORMED: list[tuple[dict[str, Any], str]] = [
    ({"qualityBias": {"reasoning": "1.5"}},
     'spec.qualityBias: reasoning must be a number from 0 to 1 written as a string, such as "0.7"'),
    ({"qualityBias": {"reasoning": "fast"}}, "got 'fast'"),
    ({"qualityBias": {"reasoning": 0.7}}, "spec.qualityBias.reasoning must be a valid string"),
    ({"tolerance": -1}, "spec.tolerance must be greater than or equal to 0"),
    ({"prefer": [{"weight": 0, "selector": {}}]}, "spec.prefer[0].weight must be greater than"),
    ({"prefer": [{"selector": {}}]}, "spec.prefer[0].weight is required"),
    ({"require": {"matchExpressions": [{"key": "params", "operator": "In"}]}},
     "In and NotIn need a non-empty list of values"),
    ({"require": {"matchExpressions": [{"key": "p", "operator": "Gt", "values": ["1"]}]}},
     "spec.require.matchExpressions[0].operator must be 'In', 'NotIn', 'Exists' or"),
    ({"requires": {}}, "unknown field spec.requires"),
    ({"qualityBias": {"reasoning": "5e-1"}}, "got '5e-1'"),  # decimals only, as the CRD
]


@pytest.mark.parametrize(("spec", "says"), MALFORMED)
def test_a_malformed_route_is_refused_saying_what_to_fix(spec: dict[str, Any], says: str
                                                         ) -> None:
    with pytest.raises(RouteError) as err:
        parse_route(manifest(**spec))
    assert says in str(err.value)


def test_a_route_name_must_be_a_model_name_clients_can_send() -> None:
    raw = manifest()
    raw["metadata"]["name"] = "bad name"
    with pytest.raises(RouteError, match="metadata.name"):
        parse_route(raw)


def test_an_empty_spec_admits_every_claim_with_the_default_tolerance() -> None:
    route = parse_route(manifest())
    assert route.tolerance == 10.0 and route.require.describe() == "(everything)"
    assert [r.score for r in rank(route, [ClaimInfo("a"), ClaimInfo("b")])] == [0.0, 0.0]
