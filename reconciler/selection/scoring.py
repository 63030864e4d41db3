"""A candidate's quality score under a route (the seed's "Scoring" and "Quality bias").

The score compares models, not placements: locality, provider weight and load are left out,
so the ranked list stays stable while GPUs come and go (the seed's "Candidate models per
call").

* With ``prefer``: the sum of the weights whose selector matches the claim's labels.
* Without ``prefer`` and with a ``qualityBias``: the effective bias ``b`` is the largest bias of
  the route's ``capabilities`` (the seed's max combiner: if any need says quality matters, the
  caller gets the quality push), else ``qualityBias.default``, else there is none and every
  score is 0. The claim's ``latencyClass`` label then contributes ``high``: 100·b,
  ``medium``: 50, ``low``: 100·(1−b), any other value or none: 0.

The seed's table for the latencyClass contribution did not survive in our copy; these three
lines are the ones its text pins down: b = 0.7 ranks high (70) > medium (50) > low (30) and
b = 0.3 flips it, each extreme tier sits |b − 0.5|·100 points from its neighbour, and medium's
margin over the better extreme, −|b − 0.5|·100, is the tent that peaks at b = 0.5.
"""

from __future__ import annotations

from collections.abc import Mapping

from reconciler.selection.route_spec import DEFAULT_BIAS_KEY, Route

LATENCY_CLASS_LABEL = "latencyClass"


def effective_bias(quality_bias: Mapping[str, float], capabilities: tuple[str, ...]
                   ) -> float | None:
    """max(bias of each capability), else the default, else None (no contribution)."""
    mapped = [quality_bias[c] for c in capabilities if c in quality_bias and c != DEFAULT_BIAS_KEY]
    if mapped:
        return max(mapped)
    return quality_bias.get(DEFAULT_BIAS_KEY)


def latency_points(latency_class: str | None, bias: float) -> float:
    if latency_class == "high":
        return 100.0 * bias
    if latency_class == "medium":
        return 50.0
    if latency_class == "low":
        return 100.0 * (1.0 - bias)
    return 0.0


class Scorer:
    """Scores claims' labels under one route (the effective bias worked out once)."""

    def __init__(self, route: Route) -> None:
        self._prefer = route.prefer
        self._bias = None if route.prefer else effective_bias(route.quality_bias,
                                                              route.capabilities)

    def score(self, labels: Mapping[str, str]) -> float:
        if self._prefer:
            return float(sum(p.weight for p in self._prefer if p.selector.matches(labels)))
        if self._bias is None:
            return 0.0
        return latency_points(labels.get(LATENCY_CLASS_LABEL), self._bias)
