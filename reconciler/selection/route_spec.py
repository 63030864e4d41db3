"""The ``ModelRoute`` manifest (``model.aibrix.ai/v1alpha1``): ask for what a model must do, not
which model (the Kubemoot seed's scheduling rule, issue 24).

``metadata.name`` is what clients send as ``model``. The spec is the seed's rule:

* ``require``: a label selector (``matchLabels`` and ``matchExpressions`` In, NotIn, Exists,
  DoesNotExist), hard: a claim it does not admit is never a candidate;
* ``prefer``: weighted selectors (``weight`` 1-100, Kubernetes' preferred-affinity bounds), soft:
  a candidate's score is the sum of the weights whose selector matches it;
* ``qualityBias``: per capability (and ``default``) a number in [0, 1] written as a string (the
  seed's CRD field is ``map[string]string`` to dodge float precision), used only when there is
  no ``prefer``, with ``capabilities`` (the caller's) combined by the seed's max rule;
* ``tolerance``: points below the preferred candidate's score that a warm candidate may be and
  still be used instead of waking the preferred one (default 10, the seed's).

The seed ignores a bias value that does not parse; we refuse the manifest instead, saying which
value to fix, because an ignored value silently changes which model serves. A bias is written as
a decimal (``BIAS_PATTERN``: "0.7", ".5", "1"; not "5e-1" or " 0.7"), the spelling the CRD's
pattern takes (``deploy/reconciler/crd-modelroutes.yaml``), so a route the API server stores is
one the reconciler takes, in either run mode. The API server's readings apply in both modes too:
a null is the field left out, and a whole float (``60.0``) is an integer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, ValidationError, field_validator

from contract.names import MAX_MODEL_NAME, MODEL_NAME_PATTERN
from reconciler.model.claim_schema import ApiShape, PodSelector, WholeInt, describe
from reconciler.model.selector import LabelSelector, selector_from

API_VERSION = "model.aibrix.ai/v1alpha1"
KIND = "ModelRoute"
DEFAULT_TOLERANCE = 10.0
DEFAULT_BIAS_KEY = "default"
BIAS_PATTERN = r"^(0*\.[0-9]+|0+(\.[0-9]*)?|0*1(\.0*)?)$"  # a decimal from 0 to 1, as the CRD's
_BIAS = re.compile(BIAS_PATTERN)
Str = Annotated[str, Strict()]


class RouteError(ValueError):
    """The manifest is malformed; the message says what to fix."""


class PreferTerm(ApiShape):
    weight: WholeInt = Field(ge=1, le=100)
    selector: PodSelector


class RouteSpecShape(ApiShape):
    require: PodSelector | None = None
    prefer: list[PreferTerm] | None = None
    qualityBias: dict[Str, Str] | None = None
    capabilities: list[Annotated[str, Strict(), Field(min_length=1)]] | None = None
    tolerance: float = Field(DEFAULT_TOLERANCE, ge=0, allow_inf_nan=False)

    @field_validator("tolerance", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)  # strict mode takes no int for a float otherwise
        return value

    @field_validator("qualityBias")
    @classmethod
    def _biases_are_fractions(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if parse_bias(text) is None:
                raise ValueError(f"{key} must be a number from 0 to 1 written as a "
                                 f"string, such as \"0.7\"; got {text!r}")
        return value


class RouteMeta(ApiShape):
    model_config = ApiShape.model_config | {"extra": "allow"}

    name: Str = Field(min_length=1, max_length=MAX_MODEL_NAME, pattern=MODEL_NAME_PATTERN)
    namespace: Str = "default"


class RouteShape(ApiShape):
    apiVersion: Literal["model.aibrix.ai/v1alpha1"]
    kind: Literal["ModelRoute"]
    metadata: RouteMeta
    spec: RouteSpecShape
    status: Any = None


def parse_bias(text: str) -> float | None:
    """A bias written as a string, or None when it is not a decimal from 0 to 1."""
    return float(text) if _BIAS.fullmatch(text) else None


@dataclass(frozen=True)
class Prefer:
    weight: int
    selector: LabelSelector


@dataclass(frozen=True)
class Route:
    """A validated route: what the selection functions read."""

    name: str
    namespace: str = "default"
    require: LabelSelector = field(default_factory=LabelSelector)
    prefer: tuple[Prefer, ...] = ()
    quality_bias: Mapping[str, float] = field(default_factory=dict, hash=False)
    capabilities: tuple[str, ...] = ()
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        object.__setattr__(self, "quality_bias", MappingProxyType(dict(self.quality_bias)))


def parse_route(raw: object) -> Route:
    """A ``Route`` from a ``ModelRoute`` manifest; raises ``RouteError`` saying what to fix."""
    try:
        shape = RouteShape.model_validate(raw)
    except ValidationError as exc:
        raise RouteError(f"ModelRoute: {describe(exc, '')}") from None
    spec = shape.spec
    return Route(
        name=shape.metadata.name, namespace=shape.metadata.namespace,
        require=selector_from(spec.require) if spec.require else LabelSelector(),
        prefer=tuple(Prefer(p.weight, selector_from(p.selector)) for p in spec.prefer or ()),
        quality_bias={k: parse_bias(v) or 0.0 for k, v in (spec.qualityBias or {}).items()},
        capabilities=tuple(spec.capabilities or ()), tolerance=spec.tolerance)
