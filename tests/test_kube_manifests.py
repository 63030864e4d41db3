"""The reconciler's Kubernetes manifests (``deploy/reconciler/``): valid for the Kubernetes
versions we support, the guide's table and names, least RBAC, and a CRD schema that agrees with
the reconciler's own claim parser on every claim generated here."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.cli import door_settings
from reconciler.model.manifests import ManifestError, claim_from_object
from runtime_agent.cli import parser as cli_parser
from reconciler.model.changes import changed_fields

ROOT = Path(__file__).resolve().parents[1]
DIR = ROOT / "deploy" / "reconciler"
KUBERNETES_VERSIONS = ("1.30.0", "1.34.0")
SAMPLES = [d for d in yaml.safe_load_all((ROOT / "samples/modelclaim/modelclaims.yaml")
                                         .read_text()) if d]


def docs() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{p.name}:{d['kind']}/{d['metadata']['name']}", d)
            for p in sorted(DIR.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]


def crd(name: str = "modelclaims.model.aibrix.ai") -> dict[str, Any]:
    (doc,) = [d for _, d in docs() if d["kind"] == "CustomResourceDefinition"
              and d["metadata"]["name"] == name]
    return doc


def version(name: str = "modelclaims.model.aibrix.ai") -> dict[str, Any]:
    (v,) = crd(name)["spec"]["versions"]
    return v


@pytest.mark.parametrize("kube_version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("name", "doc"), docs(), ids=[n for n, _ in docs()])
def test_each_manifest_passes_the_kubernetes_openapi_schema(name: str, doc: dict[str, Any],
                                                            kube_version: str) -> None:
    assert kubernetes_validate.validate(doc, kube_version, strict=True)


def test_the_kustomization_applies_every_manifest() -> None:
    kustomization = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in DIR.glob("*.yaml") if p.name != "kustomization.yaml")


def test_the_crd_is_the_guides_group_version_names_and_table() -> None:
    spec = crd()["spec"]
    assert (spec["group"], version()["name"], spec["names"]["kind"]) == (
        "model.aibrix.ai", "v1alpha1", "ModelClaim")
    assert crd()["metadata"]["name"] == "modelclaims.model.aibrix.ai"
    assert set(spec["names"]["shortNames"]) >= {"mc"}
    assert version()["subresources"] == {"status": {}}
    columns = [c["name"].upper() for c in version()["additionalPrinterColumns"]]
    assert ["NAME", *columns] == ["NAME", "PHASE", "DESIRED", "READY", "ENGINE", "ARTIFACT",
                                  "AGE"]


def test_every_field_but_per_gpu_and_replicas_is_immutable_through_cel_rules() -> None:
    rules = " ".join(r["rule"] for r in
                     version()["schema"]["openAPIV3Schema"]["properties"]["spec"][
                         "x-kubernetes-validations"])
    fields = set(version()["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])
    guarded = {f for f in fields if f"oldSelf.{f}" in rules}
    assert guarded == fields - {"perGPU", "replicas", "maxReplicas"}
    transitions = [r for r in version()["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"] if "oldSelf" in r["rule"]]
    assert len(transitions) == 5
    assert all(r["message"].endswith("create it again") for r in transitions)


def test_the_rbac_grants_only_what_the_reconciler_uses() -> None:
    rules = {(g, r): set(rule["verbs"]) for _, d in docs() if d["kind"] in ("ClusterRole", "Role")
             for rule in d["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {
        ("model.aibrix.ai", "modelclaims"): {"get", "list", "watch", "patch"},
        ("model.aibrix.ai", "modelclaims/status"): {"patch"},
        ("model.aibrix.ai", "modelroutes"): {"list", "watch"},
        ("model.aibrix.ai", "modelroutes/status"): {"patch"},
        ("", "pods"): {"list", "watch", "patch"},
        ("apps", "deployments"): {"list", "watch"},
        ("", "events"): {"create", "patch"},
        ("coordination.k8s.io", "leases"): {"get", "create", "update"},
    }
    assert not any("delete" in verbs or "*" in verbs for verbs in rules.values())


# ---- the schema and the parser agree ---------------------------------------------------------

# The CRD's CEL rules that judge a single object, and their meaning for this check (the test
# fails if a rule's text changes, so a new rule cannot be skipped silently).
CEL_ON_CREATE = {
    "self.metadata.name.size() <= 63":
        lambda obj: len(obj["metadata"]["name"]) <= 63,
    "!has(self.maxReplicas) || self.maxReplicas >= self.replicas":  # replicas defaults to 1
        lambda spec: not all(map(_count, (spec.get("maxReplicas"), spec.get("replicas", 1))))
        or spec["maxReplicas"] >= spec.get("replicas", 1),
    "!self.contains('..') && !self.contains('//') && !self.endsWith('/')":
        lambda name: ".." not in name and "//" not in name and not name.endswith("/"),
    "self.operator in ['In', 'NotIn'] ? has(self.values) && self.values.size() > 0 : "
    "!has(self.values) || self.values.size() == 0":
        lambda e: bool(e.get("values")) if e.get("operator") in ("In", "NotIn")
        else not e.get("values"),
}


def _count(value: object) -> bool:
    """A number the rule compares (other values are the schema's to refuse)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def strict(schema: Any) -> Any:
    """The structural schema as JSON Schema, with the API server's strict field validation
    (kubectl's default): unknown fields are refused."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()
           if not k.startswith("x-kubernetes") and k not in ("default", "nullable", "format")}
    if schema.get("type") == "object" and "properties" in schema and "metadata" not in schema[
            "properties"]:
        out.setdefault("additionalProperties", False)
    if schema.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def cel_rules(schema: Any, at: str = "$") -> list[tuple[str, str]]:
    found = []
    if isinstance(schema, dict):
        found += [(at, r["rule"]) for r in schema.get("x-kubernetes-validations", ())
                  if "oldSelf" not in r["rule"]]
        for key, sub in schema.get("properties", {}).items():
            found += cel_rules(sub, f"{at}.{key}")
        if "items" in schema:
            found += cel_rules(schema["items"], f"{at}[]")
    return found


def without_nulls(obj: Any, schema: Any) -> Any:
    """The object as the API server validates it: a null under a field that is not
    ``nullable`` is pruned before validation (as if the field were absent); a null under an
    unknown field stays, for strict field validation to refuse."""
    if isinstance(obj, dict) and isinstance(schema, dict):
        props = schema.get("properties", {})
        return {k: without_nulls(v, props.get(k, {})) for k, v in obj.items()
                if v is not None or k not in props or props[k].get("nullable")}
    if isinstance(obj, list) and isinstance(schema, dict):
        return [without_nulls(v, schema.get("items", {})) for v in obj]
    return obj


@functools.cache
def _claim_schema() -> tuple[dict[str, Any], Any, list[tuple[str, str]]]:
    """The CRD's schema, its validator and CEL rules, read once (a property test asks
    hundreds of times; reading the YAML each time took it past its timeout on a loaded
    machine)."""
    schema = version()["schema"]["openAPIV3Schema"]
    checked = strict(schema)
    validator = jsonschema.validators.validator_for(checked)
    validator.check_schema(checked)
    return schema, validator(checked), cel_rules(schema)


def schema_accepts(obj: dict[str, Any]) -> bool:
    schema, validator, rules = _claim_schema()
    obj = without_nulls(obj, schema)
    if not validator.is_valid(obj):
        return False
    assert {r for _, r in rules} == set(CEL_ON_CREATE), "a CEL rule this test does not know"
    spec = obj["spec"]
    checks = [CEL_ON_CREATE["self.metadata.name.size() <= 63"](obj)]
    checks += [CEL_ON_CREATE[r](spec) for p, r in rules if p == "$.spec"]
    if "modelName" in spec:
        checks += [CEL_ON_CREATE[r](spec["modelName"]) for p, r in rules
                   if p.endswith("modelName")]
    for expr in (spec.get("podSelector") or {}).get("matchExpressions") or ():
        checks.append(CEL_ON_CREATE[[r for p, r in rules if p.endswith("matchExpressions[]")][0]](
            expr))
    return all(checks)


def parser_accepts(obj: dict[str, Any]) -> bool:
    try:
        claim_from_object(obj)
    except ManifestError:
        return False
    return True


QUANTITIES = st.one_of(st.sampled_from(["6Gi", "1Gi", "0", "-1Gi", "1G", "512Mi", "1.5Gi",
                                        "six", "", "1e3", "6 Gi", ".5Ki"]),
                       st.integers(-5, 10**12), st.booleans(), st.floats(0.5, 10.0),
                       st.none())
VALUES = st.one_of(st.text(max_size=6), st.integers(0, 4096), st.booleans(), st.none(),
                   st.floats(0.5, 2.0), st.lists(st.text(max_size=2), max_size=1))


@st.composite
def claims(draw: st.DrawFn) -> dict[str, Any]:
    obj = copy.deepcopy(draw(st.sampled_from(SAMPLES)))
    spec = obj["spec"]
    obj["metadata"]["name"] = draw(st.sampled_from(
        [obj["metadata"]["name"], "a" * 63, "b" * 64, "x"]))
    for field, values in {
        "modelName": st.sampled_from(["qwen3-0.6b", "Qwen/Qwen3", "a..b", "a//b", "a/",
                                      "bad name", "-x", "x" * 128, "x" * 129, "", 7]),
        "artifactURL": st.sampled_from(["huggingface://Qwen/Qwen3-0.6B", "", "a b", 3]),
        "engine": st.sampled_from(["vllm", "sglang", "ollama", "tgi", 1]),
        "replicas": st.sampled_from([1, 2, 8, 9, 0, True, "1"]),
        "maxReplicas": st.sampled_from([1, 2, 3.0, 8, 9, 0, True, "2"]),
        "perGPU": st.one_of(st.none(), st.text(max_size=3),
                            st.fixed_dictionaries({"maximumFootprint": QUANTITIES,
                                                   "kvFloor": QUANTITIES}),
                            st.fixed_dictionaries({"maximumFootprint": QUANTITIES,
                                                   "extra": QUANTITIES})),
        "engineConfig": st.one_of(st.none(), st.fixed_dictionaries({"args": st.dictionaries(
            st.sampled_from(["--max-model-len", "--enforce-eager", "-tp"]), VALUES,
            max_size=2)}), st.just({"other": {}})),
        "podSelector": st.sampled_from([
            spec["podSelector"], {}, {"matchLabels": {"a": 1}},
            {"matchExpressions": [{"key": "a", "operator": "In"}]},
            {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
            {"matchExpressions": [{"key": "a", "operator": "Near", "values": ["b"]}]}]),
        "unknownField": st.just(1),
    }.items():
        choice = draw(st.sampled_from(["keep", "set", "drop"]))
        if choice == "set":
            value = draw(values)
            if value is None:
                spec.pop(field, None)
            else:
                spec[field] = value
        elif choice == "drop":
            spec.pop(field, None)
    return obj


@settings(max_examples=400, deadline=None)
@given(claims())
def test_the_crd_schema_and_the_parser_accept_and_refuse_the_same_claims(
        obj: dict[str, Any]) -> None:
    assert schema_accepts(obj) == parser_accepts(obj), obj


@pytest.mark.parametrize("per_gpu", [
    {"maximumFootprint": None, "kvFloor": "six"},   # found by the test above: one figure
    {"kvFloor": "6 Gi"},                             # missing did hide the other's bad shape
    {"maximumFootprint": "-1Gi", "kvFloor": True},
])
def test_each_per_gpu_figures_shape_is_judged_whatever_the_other_holds(
        per_gpu: dict[str, Any]) -> None:
    obj = copy.deepcopy(SAMPLES[0])
    obj["spec"]["perGPU"] = per_gpu
    assert not schema_accepts(obj)
    assert not parser_accepts(obj)


def test_a_whole_float_figure_is_an_integer_to_both() -> None:
    obj = copy.deepcopy(SAMPLES[0])  # found by the property test: 2.0 beside a missing figure
    obj["spec"]["perGPU"] = {"maximumFootprint": 6.0 * 2**30, "kvFloor": 2.0}
    assert schema_accepts(obj) and parser_accepts(obj)
    obj["spec"]["perGPU"] = {"kvFloor": 2.0}
    assert schema_accepts(obj) and parser_accepts(obj)  # accepted; InvalidPerGPU in status


@pytest.mark.parametrize("spec", [
    {"engineConfig": {"args": {"--max-model-len": 2048.0}}},  # whole floats are integers
    {"replicas": 1.0},
    {"engine": None},                                           # a null is the field left out
    {"perGPU": {"maximumFootprint": "6Gi", "kvFloor": "1Gi"}, "modelName": None},
])
def test_whole_floats_and_nulls_read_as_the_api_server_reads_them(spec: dict[str, Any]) -> None:
    obj = copy.deepcopy(SAMPLES[0])
    obj["spec"].update(spec)
    assert schema_accepts(obj) and parser_accepts(obj)


def test_the_guides_samples_pass_the_crd_schema_and_the_parser() -> None:
    for obj in SAMPLES:
        assert schema_accepts(obj) and parser_accepts(obj)


def test_an_edit_refused_by_the_crd_is_one_the_reconciler_keeps_from_running() -> None:
    """CEL transition rules (``self.X == oldSelf.X``) name the fields ``take_change`` guards."""
    rules = [r["rule"] for r in version()["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"]]
    guarded = sorted({m for r in rules for m in re.findall(r"oldSelf\.(\w+)", r)})
    old = claim_from_object(SAMPLES[0])
    for field in guarded:
        edited = copy.deepcopy(SAMPLES[0])
        edited["spec"][field] = {
            "modelName": "other", "artifactURL": "huggingface://x/y", "engine": "sglang",
            "replicas": 1, "podSelector": {"matchLabels": {"p": "q"}},
            "engineConfig": {"args": {"--max-model-len": "4096"}}}[field]
        new = claim_from_object(edited)
        if field == "replicas":  # a default written out is no change, for both
            assert changed_fields(old, new) == []
            continue
        assert changed_fields(old, new) == [f"spec.{field}"]


def test_the_controller_serves_the_front_door_on_the_services_openai_port() -> None:
    (dep,) = [d for _, d in docs() if d["kind"] == "Deployment"]
    (svc,) = [d for _, d in docs() if d["kind"] == "Service"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    args = cli_parser().parse_args(container["args"])
    door = door_settings(args, args.host)
    assert args.kubernetes and door is not None and door.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["openai"] == door.port == 8000
    served = {p["name"]: p for p in svc["spec"]["ports"]}
    assert (served["openai"]["port"], served["openai"]["targetPort"]) == (8000, "openai")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()


def test_the_pool_network_policy_admits_the_controller_to_the_agents_and_engines() -> None:
    (dep,) = [d for _, d in docs() if d["kind"] == "Deployment"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    namespace = dep["metadata"]["namespace"]
    policy = yaml.safe_load((ROOT / "deploy" / "networkpolicy.yaml").read_text())
    (rule,) = policy["spec"]["ingress"]
    admitted = [p for p in rule["from"]
                if p["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name":
                                                             namespace}
                and p["podSelector"]["matchLabels"].items() <= labels.items()]
    assert admitted, "the reconciler (and its front door) could not reach the pool's Pods"
