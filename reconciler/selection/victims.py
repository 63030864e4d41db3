"""Whom to release to make room for a route's choice (the seed's "Choosing victims").

Only idle models are victims: nothing in flight, idle for at least the pool's
``sleepToMakeRoomAfterSeconds``, and not already planned for release by another plan (the
reservation book says which). A model with waiters is never a victim (the seed only falls back
to them when nothing else makes room; issue 24 keeps them out: a waiter has asked for it).

Of those, the fewest that make room; among equally few, the least needed first
(``need_key``): fewer waiters, then fewer intents, then lower recent use plus prediction, then
least recently used (never used counts as longest ago). The fewest is found by taking the
largest first; then the least-needed set of that size is built one pick at a time, each pick the
least-needed occupant that still leaves a way to make room with the picks left.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter

from reconciler.selection.delay import Demand


@dataclass(frozen=True)
class Occupant:
    """A model on a GPU that could be released: ``frees`` bytes there if released, ``size``
    bytes to bring back later (0: the same as ``frees``), requests ``in_flight`` now,
    ``idle_since`` (a clock value; None: not known, so never idle), its demand, and its measured
    unload and reload times where known."""

    name: str
    frees: int
    in_flight: int = 0
    idle_since: float | None = None
    demand: Demand = field(default_factory=Demand)
    size: int = 0
    unload_s: float | None = None
    reload_s: float | None = None

    @property
    def reload_size(self) -> int:
        return self.size or self.frees

    @cached_property
    def order(self) -> tuple[tuple[int, int, float, float], str]:
        """Its place among victims, least needed first (``need_key``, then name); worked out
        once per occupant, which is replaced when its demand changes."""
        return need_key(self), self.name


def need_key(o: Occupant) -> tuple[int, int, float, float]:
    d = o.demand
    return (d.waiters, d.intents, d.recent_use + d.prediction,
            d.last_used if d.last_used is not None else float("-inf"))


_ORDER = attrgetter("order")


def choose_victims(occupants: Sequence[Occupant], need: int, now: float, idle_after_s: float,
                   planned: Collection[str] = ()) -> tuple[Occupant, ...] | None:
    """The fewest, least-needed idle occupants that free at least ``need`` bytes; ``()`` when
    nothing is needed; None when no choice makes room."""
    if need <= 0:
        return ()
    since = now - idle_after_s  # idle since at most this clock value
    pool = [o for o in occupants if o.in_flight == 0 and o.frees > 0 and o.demand.waiters == 0
            and o.idle_since is not None and o.idle_since <= since and o.name not in planned]
    if len(pool) > 1:
        pool.sort(key=_ORDER)
    by_size = sorted((o.frees for o in pool), reverse=True)
    total, k = 0, 0
    for size in by_size:
        total, k = total + size, k + 1
        if total >= need:
            break
    else:
        return None
    sizes = [o.frees for o in pool]
    picks: list[Occupant] = []
    got = 0
    for i, o in enumerate(pool):
        left = k - len(picks) - 1  # picks still to make after this one
        if left < 0:
            break
        rest = sizes[i + 1:]
        best_rest = 0 if left == 0 or not rest else (
            max(rest) if left == 1 else sum(heapq.nlargest(left, rest)))
        if got + o.frees + best_rest >= need:
            picks.append(o)
            got += o.frees
            if got >= need:
                break
    return tuple(picks)
