"""A route's candidates and their order (the seed's "Candidate models per call").

Every claim the route's ``require`` admits is a candidate, with its score (``scoring``). The
order is the seed's: the preferred candidate first, then by score (highest first), then by
smaller declared footprint (a claim that declares none comes after those that do), then by
name, so a tie never depends on the order claims were read in.

The preferred candidate is the first in that order that fits some GPU (``largest_card``: the
largest usable memory any GPU has published; None: none has, and nothing is proven too large):
the seed binds as preferred the best model that passes its feasibility filter, and a model too
large for every card must not hide the ones that fit. When none fits, the first is preferred
(and the call is refused ``model-too-large``). Readiness and live memory are not filtered here:
the per-call choice reads them, so the list stays stable while engines come and go.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from reconciler.selection.route_spec import Route
from reconciler.selection.scoring import Scorer


@dataclass(frozen=True)
class ClaimInfo:
    """What selection needs of a claim: its name (the claim key as text), labels, declared
    footprint in bytes (None: not declared), per-request context in tokens (None: not known,
    which never refuses a prompt) and engine kind (how it counts ``max_tokens``)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    footprint: int | None = None
    context: int | None = None
    engine: str = "vllm"

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))


@dataclass(frozen=True)
class Ranked:
    """One candidate: the claim and its score under the route."""

    claim: ClaimInfo
    score: float

    @property
    def name(self) -> str:
        return self.claim.name


def order_key(r: Ranked) -> tuple[float, bool, int, str]:
    """Score (highest first), then declared footprint (smaller first, undeclared last), then
    name."""
    fp = r.claim.footprint
    return (-r.score, fp is None, fp or 0, r.name)


def fits(claim: ClaimInfo, largest_card: int | None) -> bool:
    return largest_card is None or claim.footprint is None or claim.footprint <= largest_card


def rank(route: Route, claims: Iterable[ClaimInfo], largest_card: int | None = None
         ) -> tuple[Ranked, ...]:
    """The route's candidates, preferred first (see the module's docstring); empty when the
    require matches no claim."""
    scorer = Scorer(route)
    admitted = sorted((Ranked(c, scorer.score(c.labels)) for c in claims
                       if route.require.matches(c.labels)), key=order_key)
    for i, r in enumerate(admitted):
        if fits(r.claim, largest_card):
            return (r, *admitted[:i], *admitted[i + 1:]) if i else tuple(admitted)
    return tuple(admitted)
