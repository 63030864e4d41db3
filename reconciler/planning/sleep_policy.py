"""Sleep decisions: which idle models to put to sleep, and whom to put to sleep to make room. Pure.

* ``idle_to_sleep``: the awake engines idle (no request running or waiting) for at least the
  pool's ``sleepAfterSeconds``, longest idle first. Starting and sleeping engines, engines whose
  request figures or last-busy time are unknown, engines that cannot sleep (only vLLM
  sleeps) and engines not measured yet are never chosen. The controller still takes each off
  the route and checks again that no request is in progress before it sleeps it.
* ``victims``: with ``noWakeReserveWhileAsleep``, the other models on a GPU to put to sleep so
  that a waking model (or a new claim) fits: only awake engines idle for at least
  ``sleepToMakeRoomAfterSeconds``, longest idle first (``first``: the ones a route's choice
  named, before the rest), stopping as soon as the room is made.
  None when even all of them would not make room. The controller sleeps them one at a time:
  the first, then (once the agent has measured what it still holds) it asks again.
* ``make_room``: the same for a new claim that no agent has room for: the agent where the
  fewest models must sleep.

What a victim frees is its charge now less what it will hold asleep: its measured sleeping
footprint from an earlier sleep when known, else ``unknown_sleeping_footprint`` (1 GiB: what a
vLLM engine typically keeps after a level-1 sleep: its CUDA context and allocator pools). The
estimate only orders the plan; the next call sees the measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contract.quantity import GiB
from reconciler.model.policy import PoolPolicy
from reconciler.planning.placement import (
    DEFAULT_MAX_SNAPSHOT_AGE,
    ClaimNeed,
    choose_devices,
    selected,
    unavailable,
)
from reconciler.planning.state import (
    Candidate,
    EngineState,
    Gpu,
    Resident,
    charge,
    has_served,
)

DEFAULT_UNKNOWN_SLEEPING_FOOTPRINT = 1 * GiB


def _unique(engines: Sequence[Resident]) -> list[Resident]:
    seen: dict[str, Resident] = {}
    for e in engines:
        seen.setdefault(e.name, e)
    return list(seen.values())


def idle_to_sleep(engines: Sequence[Resident], policy: PoolPolicy, now: float) -> list[str]:
    """Engines to put to sleep now for being idle ``sleepAfterSeconds``, longest idle first."""
    if not policy.idle_sleep:
        return []
    picks: list[tuple[float, str]] = []
    for e in _unique(engines):
        if e.state is not EngineState.AWAKE or not e.can_sleep or e.unmeasured:
            continue
        idle = e.idle_for(now)
        if idle is not None and idle >= policy.sleep_after_seconds:
            picks.append((idle, e.name))
    return [name for _, name in sorted(picks, key=lambda p: (-p[0], p[1]))]


def may_sleep_for_room(engine: Resident, policy: PoolPolicy, now: float) -> bool:
    """Awake (not starting), able to sleep, measured (what an unmeasured engine would free is
    not known), and idle ``sleepToMakeRoomAfterSeconds`` (its claim's own, if it has one)."""
    if engine.state is not EngineState.AWAKE or not engine.can_sleep or engine.unmeasured:
        return False
    idle = engine.idle_for(now)
    after = engine.make_room_after
    return idle is not None and idle >= (policy.sleep_to_make_room_after_seconds
                                         if after is None else after)


def expected_freed(engine: Resident, policy: PoolPolicy,
                   unknown_sleeping_footprint: int = DEFAULT_UNKNOWN_SLEEPING_FOOTPRINT) -> int:
    """Bytes putting ``engine`` to sleep is expected to free on each of its GPUs."""
    after = engine.sleeping_footprint
    if after is None:
        after = unknown_sleeping_footprint
    return max(0, charge(engine, policy) - after)


def sleep_order(engines: Sequence[Resident], policy: PoolPolicy, now: float, *,
                waking: str | None = None, first: Sequence[str] = ()) -> list[Resident]:
    """The engines that may be put to sleep to make room: those named in ``first`` in that
    order, then the others longest idle first (then by name)."""
    if not policy.no_wake_reserve_while_asleep:
        return []
    out = [e for e in _unique(engines) if e.name != waking and may_sleep_for_room(e, policy, now)]
    named = {name: i for i, name in enumerate(first)}
    return sorted(out, key=lambda e: (named.get(e.name, len(named)),
                                      -(e.idle_for(now) or 0.0), e.name))


def victims(gpu_usable: int, waking_need: int, engines: Sequence[Resident],
            policy: PoolPolicy, now: float, *, waking: str | None = None, other: int = 0,
            unknown_sleeping_footprint: int = DEFAULT_UNKNOWN_SLEEPING_FOOTPRINT,
            first: Sequence[str] = ()) -> list[str] | None:
    """Engines on one GPU to put to sleep, in order, so ``waking_need`` bytes fit.

    ``engines``: every engine on the GPU; ``waking``: the one that wakes, whose own charge makes
    way for ``waking_need`` and which is never a victim; ``other``: bytes held by processes that
    are no engine's; ``first``: engines to take before the longest idle, where admissible.
    [] when it fits already; None when no admissible set makes room (or the policy keeps
    sleeping models' room, so sleeping others cannot help)."""
    gpu = Gpu(0, gpu_usable, tuple(_unique(engines)), other)
    return _victims_on((gpu,), waking_need, policy, now, waking, unknown_sleeping_footprint,
                       first)


def _victims_on(gpus: Sequence[Gpu], need: int, policy: PoolPolicy, now: float,
                waking: str | None, unknown_sleeping_footprint: int,
                first: Sequence[str] = ()) -> list[str] | None:
    """Greedy over several GPUs in ``sleep_order``, taking an engine only if it frees memory
    on a GPU still short of room, until every GPU has ``need``."""
    deficit = {g.index: need - g.room(policy, leave_out=waking) for g in gpus}
    if all(d <= 0 for d in deficit.values()):
        return []
    if not policy.no_wake_reserve_while_asleep:
        return None
    where: dict[str, list[int]] = {}
    for g in gpus:
        for e in g.engines:
            where.setdefault(e.name, []).append(g.index)
    chosen: list[str] = []
    for e in sleep_order([e for g in gpus for e in g.engines], policy, now, waking=waking,
                         first=first):
        freed = expected_freed(e, policy, unknown_sleeping_footprint)
        if freed <= 0 or not any(deficit[i] > 0 for i in where[e.name]):
            continue
        chosen.append(e.name)
        for i in where[e.name]:
            deficit[i] -= freed
        if all(d <= 0 for d in deficit.values()):
            return chosen
    return None


@dataclass(frozen=True)
class MakeRoom:
    """Put ``victims`` on ``agent`` to sleep, in order, one at a time; then place the claim on
    ``devices`` there (its Scheduled condition reads MakingRoom meanwhile)."""

    agent: str
    devices: tuple[int, ...]
    victims: tuple[str, ...]


def make_room(need: ClaimNeed, candidates: Sequence[Candidate], now: float, *,
              max_snapshot_age: float = DEFAULT_MAX_SNAPSHOT_AGE,
              unknown_sleeping_footprint: int = DEFAULT_UNKNOWN_SLEEPING_FOOTPRINT
              ) -> MakeRoom | None:
    """For a claim ``place`` could not place: the agent (in a pool with
    ``noWakeReserveWhileAsleep``) where the fewest idle models must sleep to make room; ties go
    to an agent that served the artifact, then the fewest models awake, then the name. None
    when no agent can make room."""
    room = need.room
    if room is None:
        return None
    best: tuple[tuple[int, bool, int, str, tuple[int, ...]], MakeRoom] | None = None
    for candidate in selected(need, candidates):
        if not candidate.policy.no_wake_reserve_while_asleep:
            continue
        if unavailable(need, candidate, now, max_snapshot_age) is not None:
            continue
        by_index = {g.index: g for g in candidate.gpus}
        if need.all_gpus or need.gpus > 1:
            options = [choose_devices(need, candidate)[0]]
        else:
            options = [(i,) for i in sorted(by_index)]
        for devices in options:
            chosen = _victims_on([by_index[i] for i in devices], room, candidate.policy, now,
                                 None, unknown_sleeping_footprint)
            if chosen is None:
                continue
            key = (len(chosen), not has_served(candidate, need.artifact_url),
                   candidate.models_awake, candidate.name, devices)
            if best is None or key < best[0]:
                best = (key, MakeRoom(candidate.name, devices, tuple(chosen)))
    return best[1] if best else None
