"""Kubernetes label selectors: ``matchLabels`` and ``matchExpressions`` (In, NotIn, Exists,
DoesNotExist), with Kubernetes' meaning: every term must hold; an empty selector matches every
set of labels; ``NotIn`` also matches when the key is absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, cast

Operator = Literal["In", "NotIn", "Exists", "DoesNotExist"]
OPERATORS: tuple[Operator, ...] = ("In", "NotIn", "Exists", "DoesNotExist")


class SelectorError(ValueError):
    """The selector is malformed."""


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: Operator
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        return self.key not in labels or labels[self.key] not in self.values

    def describe(self) -> str:
        if self.operator == "Exists":
            return self.key
        if self.operator == "DoesNotExist":
            return f"!{self.key}"
        word = "in" if self.operator == "In" else "notin"
        return f"{self.key} {word} ({','.join(self.values)})"


@dataclass(frozen=True)
class LabelSelector:
    match_labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    match_expressions: tuple[Requirement, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "match_labels", MappingProxyType(dict(self.match_labels)))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return (all(labels.get(k) == v for k, v in self.match_labels.items())
                and all(r.matches(labels) for r in self.match_expressions))

    def describe(self) -> str:
        """kubectl's ``-l`` form: ``a=b,c in (d,e),!f``; empty selects everything."""
        terms = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        terms += [r.describe() for r in self.match_expressions]
        return ",".join(terms) or "(everything)"


def string_map(raw: object, what: str) -> dict[str, str]:
    """A mapping of strings to strings (labels); raises ``SelectorError`` naming ``what``."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SelectorError(f"{what} must be a mapping of strings, got {type(raw).__name__}")
    out: dict[str, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key:
            raise SelectorError(f"{what}: key {key!r} must be a non-empty string")
        if not isinstance(value, str):
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            raise SelectorError(f"{what}[{key}] must be a string, got {value!r}; quote it, "
                                f"as in {key}: \"{shown}\"")
        out[key] = value
    return out


def parse_selector(raw: object, what: str = "podSelector") -> LabelSelector:
    """A ``LabelSelector`` from its Kubernetes form; raises ``SelectorError`` when malformed."""
    if not isinstance(raw, Mapping):
        raise SelectorError(f"{what} must be a mapping with matchLabels or matchExpressions")
    unknown = set(raw) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise SelectorError(f"{what} has unknown fields: {', '.join(sorted(map(str, unknown)))}")
    labels = string_map(raw.get("matchLabels"), f"{what}.matchLabels")
    exprs_raw = raw.get("matchExpressions") or []
    if not isinstance(exprs_raw, list):
        raise SelectorError(f"{what}.matchExpressions must be a list")
    exprs = tuple(_requirement(e, f"{what}.matchExpressions[{i}]")
                  for i, e in enumerate(exprs_raw))
    return LabelSelector(labels, exprs)


def _requirement(raw: Any, what: str) -> Requirement:
    if not isinstance(raw, Mapping):
        raise SelectorError(f"{what} must be a mapping with key, operator and values")
    key, op, values = raw.get("key"), raw.get("operator"), raw.get("values")
    if not isinstance(key, str) or not key:
        raise SelectorError(f"{what}.key must be a non-empty string")
    if op not in OPERATORS:
        raise SelectorError(f"{what}.operator must be one of {', '.join(OPERATORS)}, got {op!r}")
    operator = cast(Operator, op)
    if operator in ("In", "NotIn"):
        if not isinstance(values, list) or not values or not all(isinstance(v, str)
                                                                  for v in values):
            raise SelectorError(f"{what}: {operator} needs a non-empty list of string values")
        return Requirement(key, operator, tuple(values))
    if values:
        raise SelectorError(f"{what}: {operator} takes no values")
    return Requirement(key, operator)
