"""The ModelRoute CRD (``deploy/reconciler/crd-modelroutes.yaml``) and the reconciler's route
parser (``reconciler.selection.route_spec.parse_route``, both run modes) accept and refuse the
same routes: every example route of the docs and the tests, every malformed spec the parser's
tests refuse, and routes generated here. The API server's own name rule (a DNS subdomain) is
narrower than a model name: a route the API server stores always parses."""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import yaml  # type: ignore[import-untyped]
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.kube.route_status import route_status
from reconciler.selection.route_spec import BIAS_PATTERN, RouteError, parse_route
from tests.test_door_modelroute import route as door_route
from tests.test_kube_manifests import ROOT, strict, version, without_nulls
from tests.test_reconciler_kube_routes import route_obj
from tests.test_selection_spec import MALFORMED, SEED_RULE, manifest

pytestmark = pytest.mark.timeout(60)
NAME = "modelroutes.model.aibrix.ai"
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

# The CRD's CEL rules and their meaning here (a rule whose text changes fails the test, so a new
# rule cannot be skipped silently).
CEL: dict[str, Callable[[Any], bool]] = {
    "self.metadata.name.size() <= 128": lambda obj: len(obj["metadata"]["name"]) <= 128,
    "self.operator in ['In', 'NotIn'] ? has(self.values) && self.values.size() > 0 : "
    "!has(self.values) || self.values.size() == 0":
        lambda e: bool(e.get("values")) if e.get("operator") in ("In", "NotIn")
        else not e.get("values"),
}


@functools.cache
def _schemas() -> tuple[dict[str, Any], jsonschema.protocols.Validator]:
    raw = version(NAME)["schema"]["openAPIV3Schema"]
    return raw, jsonschema.validators.validator_for(strict(raw))(strict(raw))


def schema() -> dict[str, Any]:
    return _schemas()[0]


def cel_holds(obj: Any, node: Any) -> bool:
    """Every CEL rule of the schema holds where it applies in ``obj``."""
    if not isinstance(node, dict):
        return True
    for rule in node.get("x-kubernetes-validations", ()):
        if not CEL[rule["rule"]](obj):
            return False
    if isinstance(obj, dict):
        return all(cel_holds(obj[k], sub) for k, sub in node.get("properties", {}).items()
                   if k in obj)
    if isinstance(obj, list) and "items" in node:
        return all(cel_holds(item, node["items"]) for item in obj)
    return True


def crd_accepts(obj: dict[str, Any]) -> bool:
    """The CRD's schema (nulls pruned, strict field validation) and its CEL rules."""
    obj = without_nulls(obj, schema())
    return _schemas()[1].is_valid(obj) and cel_holds(obj, schema())


def api_accepts(obj: dict[str, Any]) -> bool:
    """What the API server stores: the CRD's rules and a DNS-subdomain name."""
    name = obj["metadata"]["name"]
    return isinstance(name, str) and len(name) <= 253 and bool(
        DNS_SUBDOMAIN.fullmatch(name)) and crd_accepts(obj)


def parser_accepts(obj: dict[str, Any]) -> bool:
    try:
        parse_route(obj)
    except RouteError:
        return False
    return True


def doc_examples() -> list[dict[str, Any]]:
    """Every ``kind: ModelRoute`` YAML block of the docs."""
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S):
            found += [d for d in yaml.safe_load_all(block)
                      if isinstance(d, dict) and d.get("kind") == "ModelRoute"]
    return found


EXAMPLES = [*doc_examples(), SEED_RULE, manifest(), yaml.safe_load(door_route("chat", 0)),
            route_obj("chat"), route_obj("nothing", family="llama"),
            manifest(qualityBias={"reasoning": "0.7", "default": "1"},
                     capabilities=["reasoning"], tolerance=2.5)]


def test_the_crd_is_the_groups_version_with_names_a_status_and_a_table() -> None:
    doc = yaml.safe_load((ROOT / "deploy/reconciler/crd-modelroutes.yaml").read_text())
    spec = doc["spec"]
    assert (doc["metadata"]["name"], spec["group"], spec["names"]["kind"],
            version(NAME)["name"]) == (NAME, "model.aibrix.ai", "ModelRoute", "v1alpha1")
    assert version(NAME)["subresources"] == {"status": {}}
    columns = [c["name"] for c in version(NAME)["additionalPrinterColumns"]
               if not c.get("priority")]
    assert columns == ["Candidates", "Preferred", "FailedScheduling", "Age"]


def test_the_crds_bias_pattern_is_the_parsers() -> None:
    bias = schema()["properties"]["spec"]["properties"]["qualityBias"]
    assert bias["additionalProperties"]["pattern"] == BIAS_PATTERN


def test_the_status_the_reconciler_writes_is_one_the_crd_declares() -> None:
    described = {"candidates": [{"claim": "default/big", "model": "big-model", "score": 60.0}],
                 "conditions": [{"type": "FailedScheduling", "status": "False",
                                 "reason": "Matched", "message": "1 candidate(s)"}]}
    status = route_status(described, None, 3, None, 0.0)
    obj = {**route_obj("chat"), "status": status}
    jsonschema.validate(without_nulls(obj, schema()), strict(schema()))


@pytest.mark.parametrize("obj", EXAMPLES, ids=[e["metadata"]["name"] + str(i)
                                               for i, e in enumerate(EXAMPLES)])
def test_every_example_route_is_taken_by_the_parser_and_stored_by_the_api_server(
        obj: dict[str, Any]) -> None:
    assert parser_accepts(obj) and api_accepts(obj)


@pytest.mark.parametrize(("spec", "says"), MALFORMED, ids=[s for _, s in MALFORMED])
def test_every_spec_the_parser_refuses_the_crd_refuses(spec: dict[str, Any], says: str
                                                        ) -> None:
    assert not parser_accepts(manifest(**spec)) and not crd_accepts(manifest(**spec))


@pytest.mark.parametrize("spec", [
    {"prefer": [{"weight": 60.0, "selector": {}}]},   # a whole float is an integer
    {"tolerance": None, "require": None},              # a null is the field left out
    {"tolerance": 0},
    {"qualityBias": {"default": ".5", "x": "1.000", "y": "0."}},
])
def test_the_api_servers_readings_are_the_parsers(spec: dict[str, Any]) -> None:
    assert parser_accepts(manifest(**spec)) and crd_accepts(manifest(**spec))


def test_a_model_name_that_is_no_kubernetes_name_parses_but_is_not_stored() -> None:
    obj = manifest()
    obj["metadata"]["name"] = "Qwen/Qwen3-8B"  # a route in the claims directory may be this
    assert parser_accepts(obj) and crd_accepts(obj) and not api_accepts(obj)


SELECTORS = st.sampled_from([
    {}, {"matchLabels": {"family": "qwen"}}, {"matchLabels": {"a": 1}}, {"matchLabels": None},
    {"matchExpressions": [{"key": "a", "operator": "In"}]},
    {"matchExpressions": [{"key": "a", "operator": "In", "values": ["b"]}]},
    {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
    {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["b"]}]},
    {"matchExpressions": [{"key": "", "operator": "Exists"}]},
    {"matchExpressions": [{"key": "a", "operator": "Near", "values": ["b"]}]},
    {"matchLabels": {}, "other": 1}, "family=qwen", None])
BIASES = st.sampled_from(["0.7", "0", "1", "1.0", ".5", "0.", "1.5", "2", "-0.1", "high", "",
                          "01", "1.01"])
SPEC_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "require": SELECTORS,
    "prefer": st.one_of(st.none(), st.just("x"), st.lists(st.fixed_dictionaries(
        {"weight": st.sampled_from([1, 50, 100, 0, 101, 60.0, 2.5, True, "5", None]),
         "selector": SELECTORS}), max_size=2), st.just([{"weight": 5}]),
        st.just([{"weight": 5, "selector": {}, "extra": 1}])),
    "qualityBias": st.one_of(st.none(), st.dictionaries(st.sampled_from(["default", "x"]),
                                                        st.one_of(BIASES, st.just(0.5)),
                                                        max_size=2)),
    "capabilities": st.one_of(st.none(), st.lists(st.sampled_from(["reasoning", "", 3]),
                                                  max_size=2), st.just("reasoning")),
    "tolerance": st.sampled_from([0, 10, 2.5, -1, "10", True, None, 1e9]),
    "unknownField": st.just(1),
}


@st.composite
def routes(draw: st.DrawFn) -> dict[str, Any]:
    obj: dict[str, Any] = copy.deepcopy(draw(st.sampled_from(EXAMPLES)))
    obj["metadata"]["name"] = draw(st.sampled_from(
        [obj["metadata"]["name"], "a" * 128, "b" * 129, "x", "chat.v2", "a..b"]))
    spec = obj["spec"]
    for field, values in SPEC_FIELDS.items():
        choice = draw(st.sampled_from(["keep", "set", "drop"]))
        if choice == "set":
            spec[field] = draw(values)
        elif choice == "drop":
            spec.pop(field, None)
    return obj


@settings(max_examples=400, deadline=None)
@given(routes())
def test_the_crd_schema_and_the_parser_accept_and_refuse_the_same_routes(
        obj: dict[str, Any]) -> None:
    assert crd_accepts(obj) == parser_accepts(obj), obj
    if api_accepts(obj):
        assert parser_accepts(obj)
