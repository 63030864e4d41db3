"""Claim first, then release: the reservation book of plans that bring a model up on a GPU
(the seed's "Claim first, then release" and "Ticket claim and crash-safe release").

A plan reserves the bytes it brings onto a GPU and carries the victims it will release for
them. ``claim`` admits a plan only when the loads of every live plan on that GPU, this one's
included, fit in the GPU's free memory plus the credit: each distinct victim planned by any
live plan there, counted once, and only while it is still resident. Two planners that picked
the same victim therefore cannot both spend its memory: the second sees both loads against one
victim's credit and is refused. A plan is also refused when one of its victims took a request
meanwhile.

A plan ends by ``release`` (the request ended, or the snapshot now shows the load it reserved)
or by its ``expires_at`` passing (``live``): the second layer, so a plan whose holder died is
never kept. The book is a value: every change returns a new book, and the one place that owns
it swaps it in.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Plan:
    """``load`` bytes of ``model`` onto ``gpu``, releasing ``victims`` (name: bytes freed)."""

    id: str
    gpu: str
    model: str
    load: int
    expires_at: float
    victims: Mapping[str, int] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "victims", MappingProxyType(dict(self.victims)))


@dataclass(frozen=True)
class Book:
    plans: tuple[Plan, ...] = ()

    def live(self, now: float) -> Book:
        """The book without plans whose time has passed."""
        kept = tuple(p for p in self.plans if p.expires_at > now)
        return self if len(kept) == len(self.plans) else Book(kept)

    def release(self, plan_id: str) -> Book:
        return Book(tuple(p for p in self.plans if p.id != plan_id))

    def on(self, gpu: str) -> tuple[Plan, ...]:
        return tuple(p for p in self.plans if p.gpu == gpu)

    def planned_victims(self) -> frozenset[str]:
        return frozenset(v for p in self.plans for v in p.victims)

    def intents(self, model: str) -> int:
        return sum(1 for p in self.plans if p.model == model)

    def pending(self, gpu: str) -> int:
        """Bytes live plans bring onto ``gpu``."""
        return sum(p.load for p in self.on(gpu))

    def credit(self, gpu: str, resident: Collection[str],
               extra: Mapping[str, int] | None = None) -> int:
        """Each distinct victim planned on ``gpu`` (and in ``extra``), once, while resident."""
        victims: dict[str, int] = {}
        for p in self.on(gpu):
            victims.update(p.victims)
        victims.update(extra or {})
        return sum(size for name, size in victims.items() if name in resident)

    def claim(self, plan: Plan, free: int, resident: Collection[str],
              busy: Collection[str] = ()) -> Book | None:
        """The book with ``plan`` added, or None when the GPU's budget does not hold it:
        ``free`` is the GPU's free bytes as last observed, ``resident`` the models on it now,
        ``busy`` those with a request in flight."""
        if any(v in busy for v in plan.victims):
            return None
        loads = self.pending(plan.gpu) + plan.load
        if loads > free + self.credit(plan.gpu, resident, plan.victims):
            return None
        return Book((*self.plans, plan))
