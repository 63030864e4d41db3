"""The claim models (``reconciler.model.claim_schema``) are the CRD's spec schema: the JSON
schema pydantic derives from ``ClaimSpec`` and the CRD's openAPIV3Schema for ``spec`` say the
same at every level (property names, required lists, types, enums, patterns, bounds,
defaults), once what legitimately differs in how the two write it is normalised. A field added
to one and not the other fails here; the property test in tests/test_kube_manifests.py checks
that both accept and refuse the same claims."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from pydantic import BaseModel, create_model

from contract.engines import CLAIM_ENGINES
from reconciler.model.claim_schema import ClaimSpec, EngineConfig, PerGPUSpec

CRD = Path(__file__).resolve().parents[1] / "deploy" / "reconciler" / "crd-modelclaims.yaml"


def crd_spec() -> dict[str, Any]:
    (version,) = yaml.safe_load(CRD.read_text())["spec"]["versions"]
    spec: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec


def from_crd(schema: Any) -> Any:
    """The CRD's schema as the models write it: an int-or-string's pattern judges only its
    string (JSON Schema ignores a pattern on an integer); an object with properties refuses
    unknown fields (kubectl's strict field validation); CEL rules are the models' validators,
    judged by the parity test, not here."""
    if not isinstance(schema, dict):
        return schema
    out = {k: from_crd(v) for k, v in schema.items()
           if k not in ("x-kubernetes-validations", "x-kubernetes-int-or-string", "properties",
                        "description")}
    if "properties" in schema:
        out["properties"] = {k: from_crd(v) for k, v in schema["properties"].items()}
        out["additionalProperties"] = False
    if schema.get("x-kubernetes-int-or-string"):
        pattern = out.pop("pattern", None)
        out["anyOf"] = [{"type": "integer"},
                        {"type": "string", **({"pattern": pattern} if pattern else {})}]
    return out


def from_model(schema: Any, defs: dict[str, Any] | None = None) -> Any:
    """pydantic's JSON schema as the CRD writes it: ``$ref`` inlined, no titles, and an optional
    field without its ``null`` (the API server prunes a null under a field that is not
    nullable before it validates; the models read a null as the field left out)."""
    if isinstance(schema, list):
        return [from_model(s, defs) for s in schema]
    if not isinstance(schema, dict):
        return schema
    defs = schema.get("$defs", defs) or {}
    if "$ref" in schema:
        return from_model(defs[schema["$ref"].removeprefix("#/$defs/")], defs)
    out = {k: v for k, v in schema.items() if k not in ("$defs", "title", "description")}
    if out.get("default", 0) is None:
        del out["default"]
    if "anyOf" in out:
        kinds = [from_model(s, defs) for s in out["anyOf"] if s != {"type": "null"}]
        del out["anyOf"]
        if len(kinds) == 1:
            out.update(kinds[0])
        else:
            out["anyOf"] = kinds
    if "properties" in out:
        out["properties"] = {k: from_model(v, defs) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if key in out:
            out[key] = from_model(out[key], defs)
    return out


def differences(crd: Any, model: Any, at: str = "spec") -> list[str]:
    """Where the two schemas part, each as ``path: what``."""
    if isinstance(crd, dict) and isinstance(model, dict):
        found = [f"{at}: {k!r} only in the CRD" for k in crd if k not in model]
        found += [f"{at}: {k!r} only in the model" for k in model if k not in crd]
        for key in (k for k in crd if k in model):
            a, b = crd[key], model[key]
            if key == "required":
                a, b = sorted(a), sorted(b)
            found += differences(a, b, f"{at}.{key}")
        return found
    if isinstance(crd, list) and isinstance(model, list) and len(crd) == len(model):
        return [d for i, (a, b) in enumerate(zip(crd, model, strict=True))
                for d in differences(a, b, f"{at}[{i}]")]
    return [] if crd == model else [f"{at}: CRD {crd!r}, model {model!r}"]


def compare(crd: dict[str, Any], model: type[BaseModel]) -> list[str]:
    return differences(from_crd(crd), from_model(model.model_json_schema()))


def test_the_claim_models_say_what_the_crds_spec_schema_says() -> None:
    assert compare(crd_spec(), ClaimSpec) == []


def test_the_comparison_reaches_every_field_of_the_crd() -> None:
    """Every property the CRD declares, at any depth, is in the normalised model schema."""
    def paths(schema: Any, at: str = "") -> set[str]:
        found: set[str] = set()
        for key, sub in (schema.get("properties") or {}).items():
            found |= {f"{at}.{key}"} | paths(sub, f"{at}.{key}")
        if isinstance(schema.get("items"), dict):
            found |= paths(schema["items"], f"{at}[]")
        return found

    model = from_model(ClaimSpec.model_json_schema())
    assert paths(crd_spec()) == paths(model)
    assert len(paths(crd_spec())) >= 15


def _crd_with(path: list[str], change: Any) -> dict[str, Any]:
    schema = copy.deepcopy(crd_spec())
    node = schema
    for key in path[:-1]:
        node = node[key]
    if change is None:
        del node[path[-1]]
    else:
        node[path[-1]] = change
    return schema


@pytest.mark.parametrize("path, change", [
    (["properties", "perGPU", "properties", "hostMemory"], {"type": "string"}),
    (["properties", "priority"], {"type": "integer"}),
    (["properties", "engineConfig", "properties", "args"], None),
    (["required"], ["podSelector"]),
    (["properties", "engine", "enum"], ["vllm", "sglang", "ollama", "tgi"]),
    (["properties", "engine", "default"], "sglang"),
    (["properties", "artifactURL", "pattern"], "^.+$"),
    (["properties", "replicas", "maximum"], 9),
    (["properties", "perGPU", "properties", "kvFloor", "pattern"], "^[0-9]+$"),
    (["properties", "podSelector", "properties", "matchExpressions", "items", "required"],
     ["key"]),
    (["properties", "engineConfig", "properties", "args", "additionalProperties"],
     {"type": "string"}),
])
def test_a_crd_that_says_something_else_fails_the_comparison(path: list[str],
                                                             change: Any) -> None:
    assert compare(_crd_with(path, change), ClaimSpec) != []


def test_a_model_with_a_field_the_crd_lacks_fails_the_comparison() -> None:
    wider_gpu = create_model("WiderGPU", __base__=PerGPUSpec, hostMemory=(str | None, None))
    wider = create_model("Wider", __base__=ClaimSpec, perGPU=(wider_gpu, None))
    (found,) = compare(crd_spec(), wider)
    assert "hostMemory" in found and "only in the model" in found
    same = create_model("Same", __base__=ClaimSpec, engineConfig=(EngineConfig | None, None))
    assert compare(crd_spec(), same) == []  # the same field declared again compares equal
    assert compare(crd_spec(), create_model("Required", __base__=ClaimSpec,
                                            modelName=(str, ...))) != []


def test_the_claim_engines_are_the_contracts() -> None:
    assert tuple(crd_spec()["properties"]["engine"]["enum"]) == CLAIM_ENGINES
