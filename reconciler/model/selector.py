"""Kubernetes label selectors: ``matchLabels`` and ``matchExpressions`` (In, NotIn, Exists,
DoesNotExist), with Kubernetes' meaning: every term must hold; an empty selector matches every
set of labels; ``NotIn`` also matches when the key is absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pydantic import ValidationError

from reconciler.model.claim_schema import Operator, PodSelector, describe


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


def parse_selector(raw: object, what: str = "podSelector") -> LabelSelector:
    """A ``LabelSelector`` from its Kubernetes form; raises ``SelectorError`` when malformed."""
    try:
        return selector_from(PodSelector.model_validate(raw))
    except ValidationError as exc:
        raise SelectorError(describe(exc, what)) from None


def selector_from(spec: PodSelector) -> LabelSelector:
    """The selector a validated ``podSelector`` says."""
    return LabelSelector(spec.matchLabels or {}, tuple(
        Requirement(e.key, e.operator, tuple(e.values or ())) for e in spec.matchExpressions or ()))
