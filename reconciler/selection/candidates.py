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

from collections.abc import Iterable, Iterator, Mapping
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
    """One candidate: the claim, its name and its score under the route."""

    claim: ClaimInfo
    score: float
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.claim.name)


@dataclass(frozen=True)
class Candidates:
    """A route's ranked candidates, with what every call would otherwise work out again: the
    end of the run of candidates within ``tolerance`` of the first, and that run's narrowest
    known context and largest declared footprint (so a call whose prompt and GPUs fit them all
    takes the run as it is); and over all candidates the widest context (None when one is not
    known) and the smallest declared footprint (None when one is not declared), so a call no
    candidate can hold is refused without looking at each."""

    ranked: tuple[Ranked, ...]
    tolerance: float
    tolerance_end: int = field(init=False)
    narrowest: int | None = field(init=False)
    largest: int | None = field(init=False)
    widest: int | None = field(init=False)
    smallest: int | None = field(init=False)
    names: tuple[str, ...] = field(init=False)
    tolerance_set: frozenset[str] = field(init=False)
    position: Mapping[str, int] = field(init=False, hash=False)

    def __post_init__(self) -> None:
        end = 0
        if self.ranked:
            floor = self.ranked[0].score - self.tolerance
            end = 1 + next((i for i, r in enumerate(self.ranked[1:]) if r.score < floor),
                           len(self.ranked) - 1)
        run = self.ranked[:end]
        contexts = [r.claim.context for r in run if r.claim.context is not None]
        footprints = [r.claim.footprint for r in run if r.claim.footprint is not None]
        object.__setattr__(self, "tolerance_end", end)
        object.__setattr__(self, "narrowest", min(contexts) if contexts else None)
        object.__setattr__(self, "largest", max(footprints) if footprints else None)
        object.__setattr__(self, "names", tuple(r.name for r in self.ranked))
        object.__setattr__(self, "tolerance_set", frozenset(self.names[:end]))
        object.__setattr__(self, "position", MappingProxyType(
            {r.name: i for i, r in enumerate(self.ranked)}))
        every = [r.claim for r in self.ranked]
        known = all(c.context is not None for c in every)
        declared = all(c.footprint is not None for c in every)
        object.__setattr__(self, "widest", max(c.context or 0 for c in every)
                           if every and known else None)
        object.__setattr__(self, "smallest", min(c.footprint or 0 for c in every)
                           if every and declared else None)

    def __len__(self) -> int:
        return len(self.ranked)

    def __iter__(self) -> Iterator[Ranked]:
        return iter(self.ranked)

    def __getitem__(self, i: int) -> Ranked:
        return self.ranked[i]


def order_key(r: Ranked) -> tuple[float, bool, int, str]:
    """Score (highest first), then declared footprint (smaller first, undeclared last), then
    name."""
    fp = r.claim.footprint
    return (-r.score, fp is None, fp or 0, r.name)


def fits(claim: ClaimInfo, largest_card: int | None) -> bool:
    return largest_card is None or claim.footprint is None or claim.footprint <= largest_card


def rank(route: Route, claims: Iterable[ClaimInfo], largest_card: int | None = None
         ) -> Candidates:
    """The route's candidates, preferred first (see the module's docstring); empty when the
    require matches no claim."""
    scorer = Scorer(route)
    admitted = sorted((Ranked(c, scorer.score(c.labels)) for c in claims
                       if route.require.matches(c.labels)), key=order_key)
    for i, r in enumerate(admitted):
        if fits(r.claim, largest_card):
            if i:
                admitted.insert(0, admitted.pop(i))
            break
    return Candidates(tuple(admitted), route.tolerance)
