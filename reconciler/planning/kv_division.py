"""Dividing one GPU among its engines: a KV-cache limit for each. Pure.

The rule (the guide's, made exact):

1. Every engine keeps its footprint. An engine that is awake or starting gets at least its KV
   floor. A sleeping engine keeps its KV floor reserved (its limit is its floor) by default;
   with ``noWakeReserveWhileAsleep`` and a measured sleeping footprint it holds only that
   footprint and gets no limit at all (it is left out of the answer: kvcached ignores a limit
   of 0 and the agent refuses one, and the engine's KV cache was freed by its sleep). While its
   sleeping footprint is unknown it keeps its whole room, floor included.
2. The rest, ``spare = usable - footprints - floors - what sleeping engines hold``, goes to the
   awake (and starting) engines' KV caches; an engine whose KV in use (``kv_used``) is above its
   floor keeps that much first (kvcached frees no live KV: a lower limit would free nothing
   until its requests finish, and the others would grow into memory still held). The rest is
   shared in proportion to a weight ``1 + band(load)``, where
   ``load`` is requests running + waiting and ``band`` is the largest power of two not above it
   (0 when idle or unknown; 1, 2, 4, 8, ...). So an engine with a request in flight weighs twice
   an idle one, and the busy ones get more.
3. An engine not measured yet (``Resident.unmeasured``) gets no limit: its size is unknown, so
   it is placed only on a GPU of its own (``placement``); if another engine shares its GPU, it
   counts with what it was seen to hold, like a sleeping engine's charge.
4. Each share is rounded down to a whole ``quantum`` (64 MiB), so the sum never passes the card;
   what rounding leaves (less than one quantum per engine) stays unassigned.

Stability: the answer depends only on the input (no clock, no randomness). Load enters only
through its power-of-two band, so jitter inside a band (5 vs 7 requests) changes nothing. Across
a band edge, hysteresis holds: when every awake engine already runs with a limit (``kv_limit``)
that is at least its floor, within ``hysteresis`` (256 MiB) of its new share, and the current
limits together fit the card, the current limits are kept as they are. Limits move only when
some engine would move by at least ``hysteresis``, or an engine starts, stops, sleeps or wakes.

``order_changes`` turns current and planned limits into the order to apply them: every shrink
first, then every grow, so the limits never add up to more than the card at any step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from contract.quantity import MiB
from reconciler.model.policy import POLICY_OFF, PoolPolicy
from reconciler.planning.state import (
    Gpu,
    Resident,
    charge,
    holds_only_sleeping_footprint,
)

QUANTUM = 64 * MiB
HYSTERESIS = 256 * MiB


def load_band(load: float | None) -> int:
    """0 when idle or unknown, else the largest power of two not above ``load``."""
    if load is None or load < 1:
        return 0
    return 1 << (int(load).bit_length() - 1)


def weight(engine: Resident) -> int:
    return 1 + load_band(engine.load)


def _check_names(engines: Sequence[Resident]) -> None:
    names = [e.name for e in engines]
    if len(set(names)) != len(names):
        raise ValueError(f"engine names must be unique on a GPU: {sorted(names)}")


def divide(gpu_usable: int, engines: Sequence[Resident], policy: PoolPolicy = POLICY_OFF, *,
           quantum: int = QUANTUM, hysteresis: int = HYSTERESIS) -> dict[str, int]:
    """KV limits (bytes) for the engines on one GPU with ``gpu_usable`` bytes usable.

    Every engine that holds a KV reservation is in the answer; a sleeping engine that holds
    only its measured sleeping footprint (``noWakeReserveWhileAsleep``) is not. When even the
    footprints and floors do not fit (a card already over-committed), the awake engines get
    their floors and nothing more."""
    if quantum < 1:
        raise ValueError("quantum must be >= 1")
    _check_names(engines)
    awake = [e for e in engines if not e.asleep and not e.unmeasured]
    limits: dict[str, int] = {e.name: e.kv_floor for e in engines if e.asleep
                              and not e.unmeasured and not holds_only_sleeping_footprint(e, policy)}
    fixed = sum(e.footprint for e in awake) + sum(charge(e, policy) for e in engines
                                                  if e.asleep or e.unmeasured)
    if not awake:
        return limits
    if gpu_usable - fixed - sum(e.kv_floor for e in awake) <= 0:
        limits.update({e.name: e.kv_floor for e in awake})
        return limits
    # KV in use stays: kvcached frees no live KV, so a limit below it would free nothing now.
    held = {e.name: max(e.kv_floor, e.kv_used or 0) for e in awake}
    spare = max(0, gpu_usable - fixed - sum(held.values()))
    weights = {e.name: weight(e) for e in awake}
    total = sum(weights.values())
    planned = {e.name: held[e.name] + spare * weights[e.name] // (total * quantum) * quantum
               for e in awake}
    if _keep_current(awake, planned, gpu_usable - fixed, hysteresis):
        planned = {e.name: e.kv_limit for e in awake if e.kv_limit is not None}
    limits.update(planned)
    return limits


def _keep_current(awake: Sequence[Resident], planned: Mapping[str, int], budget: int,
                  hysteresis: int) -> bool:
    """Hysteresis: the current limits stand when all are known, at least their floors, near the
    plan, and together within ``budget`` (the bytes left for awake KV caches)."""
    current = [e.kv_limit for e in awake]
    if any(c is None for c in current):
        return False
    if sum(c for c in current if c is not None) > budget:
        return False
    return all(e.kv_limit is not None and e.kv_limit >= e.kv_floor
               and abs(planned[e.name] - e.kv_limit) < hysteresis for e in awake)


def divide_gpus(gpus: Sequence[Gpu], policy: PoolPolicy = POLICY_OFF, *,
                quantum: int = QUANTUM, hysteresis: int = HYSTERESIS) -> dict[str, int]:
    """KV limits for every engine of an agent: each GPU divided on its own (memory held by
    other processes set aside), an engine on several GPUs getting the least of its shares, so
    no GPU is over-committed."""
    out: dict[str, int] = {}
    for gpu in gpus:
        for name, limit in divide(gpu.usable - gpu.other, gpu.engines, policy,
                                  quantum=quantum, hysteresis=hysteresis).items():
            out[name] = min(limit, out.get(name, limit))
    return out


def committed(engines: Sequence[Resident], limits: Mapping[str, int],
              policy: PoolPolicy = POLICY_OFF) -> int:
    """Bytes the engines on one GPU hold or may grow to with these limits: footprint + limit for
    each engine with a limit, and its charge for a sleeping one without."""
    total = 0
    for e in engines:
        if e.name in limits:
            total += e.footprint + limits[e.name]
        else:
            total += charge(e, policy)
    return total


@dataclass(frozen=True)
class LimitChange:
    engine: str
    old: int | None  # None: not known (a new engine's segment starts at its full capacity)
    new: int


def order_changes(current: Mapping[str, int | None], planned: Mapping[str, int]
                  ) -> tuple[list[LimitChange], list[LimitChange]]:
    """(shrinks, grows): apply every shrink (confirmed) before any grow.

    Shrinks come largest first (an unknown current limit counts as the largest: a new engine's
    segment starts at full capacity, so its limit can only come down), grows smallest first.
    Engines absent from ``planned`` are left alone; unchanged limits are not listed."""
    shrinks: list[LimitChange] = []
    grows: list[LimitChange] = []
    for name in sorted(planned):
        old, new = current.get(name), planned[name]
        if old is None or new < old:
            shrinks.append(LimitChange(name, old, new))
        elif new > old:
            grows.append(LimitChange(name, old, new))
    shrinks.sort(key=lambda c: (c.old is not None, -((c.old or 0) - c.new), c.engine))
    grows.sort(key=lambda c: (c.new - (c.old or 0), c.engine))
    return shrinks, grows
