"""The structural shape of a ModelClaim (its spec, its label selector, the metadata we read) as
pydantic models, so a manifest is refused exactly where the CRD's openAPIV3Schema refuses it;
and of our own WarmPool's spec, which has no CRD (``PoolSpec`` is its schema).

``deploy/reconciler/crd-modelclaims.yaml`` is the one source: tests/test_claim_schema.py derives
the JSON schema of ``ClaimSpec`` and compares it with the CRD's, level by level (names, required
lists, types, enums, patterns, bounds, defaults), so a field added to one and not the other fails
the suite. The CRD's per-object CEL rules are the model validators here. What the CRD cannot say
(the contract's engine-argument and model-name rules, perGPU figures that must be positive) stays
in plain functions in ``reconciler.model.manifests``, run after this validation.

Two readings follow the API server: a null under a declared field is the field left out (it
prunes nulls before it validates), and a whole float is an integer (JSON's ``2.0`` is ``2``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    Strict,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from annotated_types import Ge, Le
from pydantic_core import core_schema

from contract.names import MAX_MODEL_NAME, MODEL_NAME_PATTERN
from reconciler.replicas import MAX_REPLICAS

# The CRD's patterns, as written there (the model name's is the contract's).
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


def _whole(value: object) -> object:
    """JSON's 2.0 is the integer 2 to the API server and to its schema."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@dataclass(frozen=True)
class _IntOrString:
    """``x-kubernetes-int-or-string``: an integer or a string (matching ``pattern``), with one
    error that says what to write instead of one per union member."""

    pattern: str | None
    error: str

    def __get_pydantic_core_schema__(self, source: Any,
                                     handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(_whole, core_schema.union_schema(
            [core_schema.int_schema(strict=True),
             core_schema.str_schema(strict=True, pattern=self.pattern)],
            custom_error_type="int_or_string", custom_error_message=self.error))


Quantity = Annotated[int | str, _IntOrString(
    QUANTITY_PATTERN, "must be bytes or a quantity such as 6Gi")]
ArgValue = Annotated[int | str, _IntOrString(
    None, 'must be a string ("" for a flag without a value) or an integer')]
Engine = Literal["vllm", "sglang", "ollama"]  # contract.engines.CLAIM_ENGINES (a test checks)
Operator = Literal["In", "NotIn", "Exists", "DoesNotExist"]
WholeInt = Annotated[int, BeforeValidator(_whole), Strict()]
Str = Annotated[str, Strict()]
ReplicaBound = Annotated[int, Ge(1), Le(MAX_REPLICAS), BeforeValidator(_whole), Strict()]
Labels = dict[Str, Str]


class _Shape(BaseModel):
    """Unknown fields are refused (kubectl's strict field validation); a null is an absent
    field (the API server prunes it); nothing is coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


ApiShape = _Shape  # the API server's reading, for the shapes of our other CRDs (ModelRoute)


class SelectorRequirement(_Shape):
    key: Str = Field(min_length=1)
    operator: Operator
    values: list[Str] | None = None

    @model_validator(mode="after")
    def _values_fit_the_operator(self) -> SelectorRequirement:  # the CRD's CEL rule
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError("In and NotIn need a non-empty list of values; Exists and "
                             "DoesNotExist take none")
        return self


class PodSelector(_Shape):
    matchLabels: Labels | None = None
    matchExpressions: list[SelectorRequirement] | None = None


class PerGPUSpec(_Shape):
    maximumFootprint: Quantity | None = None
    kvFloor: Quantity | None = None


class EngineConfig(_Shape):
    args: dict[Str, ArgValue] | None = None


class ClaimSpec(_Shape):
    modelName: Str | None = Field(None, min_length=1, max_length=MAX_MODEL_NAME,
                                  pattern=MODEL_NAME_PATTERN)
    podSelector: PodSelector
    artifactURL: Str = Field(min_length=1, pattern=r"^\S+$")
    engine: Engine = "vllm"
    replicas: WholeInt = Field(1, ge=1, le=MAX_REPLICAS)
    maxReplicas: ReplicaBound | None = None  # copies by demand: at least replicas
    perGPU: PerGPUSpec | None = None
    engineConfig: EngineConfig | None = None


class ObjectMeta(_Shape):
    """The metadata we read (Kubernetes' ObjectMeta is the API server's, not the CRD's; the
    rest, such as annotations, is read where it is used)."""

    model_config = ConfigDict(extra="allow")

    name: Str = Field(min_length=1)
    namespace: Str = Field("default", pattern=DNS_LABEL_PATTERN)
    labels: Labels = {}


class AgentSpec(_Shape):
    name: Str = Field(min_length=1)
    url: Str = Field(pattern=r"^https?://[^/\s:]+(:\d{1,5})?/?$")
    labels: Labels = {}


class PoolSpec(_Shape):
    """Our own ``kind: WarmPool`` (no CRD: this model is its schema)."""

    agents: list[AgentSpec] | None = None
    policy: Any = None  # an object or its JSON text, judged by ``parse_pool_policy``


_SHOULD = re.compile(r"^\w+ should ")
# Said when a required field is missing, after "<path> is required".
_HINTS = {
    "spec.podSelector": ": select the pool, usually by matchLabels "
                        "{claim.model.aibrix.ai/pool: <pool>}",
    "spec.artifactURL": ", such as huggingface://Qwen/Qwen3-0.6B",
}


def field_path(prefix: str, loc: tuple[int | str, ...]) -> str:
    """``spec.perGPU.kvFloor``, ``spec.engineConfig.args[--max-model-len]``,
    ``spec.podSelector.matchExpressions[0]``."""
    path = prefix
    for part in loc:
        if isinstance(part, int) or not part.isidentifier():
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    return path


def describe(exc: ValidationError, prefix: str) -> str:
    """Every error of ``exc`` in one line, each naming its field from ``prefix`` on."""
    said: list[str] = []
    for err in exc.errors(include_url=False):
        path = field_path(prefix, err["loc"])
        kind, msg = err["type"], err["msg"]
        if kind == "missing":
            said.append(f"{path} is required{_HINTS.get(path, '')}")
        elif kind == "extra_forbidden":
            said.append(f"unknown field {path}")
        elif kind == "value_error":  # a CEL rule's message says it all
            said.append(f"{path}: {msg.removeprefix('Value error, ')}")
        else:
            if kind in ("model_type", "dict_type"):
                msg = "must be a mapping"
            said.append(f"{path} {_SHOULD.sub('must ', msg)}, "
                        f"got {err['input']!r}")
    return "; ".join(said)


LABELS: TypeAdapter[Labels | None] = TypeAdapter(Labels | None)
