"""What the door knows of memory when a route's preferred model sleeps (issue 24, item 4). Pure.

The door's per-call choice reads memory only where it can read it right: a sleeping claim's
engine on one GPU of an agent whose last snapshot answered. For that engine, ``room_for``
turns the agent's planner candidate (``planning.state``, the same one the reconciler's wake
reads: its engines' charges, what is no engine's, the reconciler's live reservations) into

* the copy's ``needs``: what it must add on the GPU to wake, its room (footprint plus KV floor)
  less what it is charged there asleep; and
* the GPU (``GpuView``): its usable bytes, its free bytes (``Gpu.room``), and, in a pool with
  ``noWakeReserveWhileAsleep`` (elsewhere sleeping another model frees nothing for a wake),
  the awake models the reconciler could put to sleep for room (``Occupant``): vLLM engines,
  measured, each with what sleeping it is expected to free (``sleep_policy.expected_freed``),
  its requests in flight (the door's and what the engine reports running or waiting), and its
  demand (``Usage``: held requests, plans that intend it, its recent use, its last use).

An occupant's ``idle_since`` is the clock value from which it is idle *enough* to be slept for
room: when its requests last ended plus its own ``sleepToMakeRoomAfterSeconds`` (its claim's,
else its pool's); None while busy, never idle, or never to be slept for room. The door's view
therefore carries ``idle_after_s`` 0: each occupant's threshold is in its own value.

Names are the view's: a copy's ``engine`` is its claim's key text (``ns/name``), and so is an
occupant's, so a warm copy some live plan will release is never taken as warm. ``models`` maps
each occupant's name back to its model name on the agent: what the wake request carries to
the reconciler (``WakeRequest.victims``), which sleeps those first when they may be slept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from reconciler.planning.sleep_policy import expected_freed
from reconciler.planning.state import Candidate, EngineState, charge
from reconciler.selection.delay import Demand
from reconciler.selection.view import GpuView
from reconciler.selection.victims import Occupant

# What the door reads of an occupant, by its model name on the agent: (requests the door has
# in flight to it, its demand).
UsageOf = Callable[[str], tuple[int, Demand]]


@dataclass(frozen=True)
class Room:
    """A sleeping copy's GPU as the door sees it: the bytes its wake adds, the GPU, and each
    occupant's model name on the agent by its name in the view."""

    needs: int
    gpu: GpuView
    models: Mapping[str, str] = field(default_factory=dict, hash=False)


def gpu_id(agent: str, index: int) -> str:
    return f"{agent}/{index}"


def room_for(cand: Candidate, device: int, waking: str, room: int, now: float,
             usage: UsageOf, name_of: Callable[[str], str]) -> Room | None:
    """The door's view of ``device`` on ``cand`` for the sleeping engine ``waking`` (its model
    name there) that needs ``room`` bytes awake; None when the GPU is not in the snapshot.
    ``name_of``: a model name on the agent to its name in the view."""
    gpu = next((g for g in cand.gpus if g.index == device), None)
    if gpu is None:
        return None
    policy = cand.policy
    own = next((charge(e, policy) for e in gpu.engines if e.name == waking), 0)
    occupants: list[Occupant] = []
    models: dict[str, str] = {}
    if policy.no_wake_reserve_while_asleep:
        for e in gpu.engines:
            if e.name == waking or e.state is not EngineState.AWAKE or not e.can_sleep \
                    or e.unmeasured:
                continue
            frees = expected_freed(e, policy)
            if frees <= 0:
                continue
            door_in_flight, demand = usage(e.name)
            after = policy.sleep_to_make_room_after_seconds if e.make_room_after is None \
                else e.make_room_after
            idle = e.idle_for(now)
            since = None if idle is None or after == float("inf") else now - idle + after
            name = name_of(e.name)
            models[name] = e.name
            occupants.append(Occupant(name, frees, door_in_flight + int(e.load or 0), since,
                                      demand, size=e.footprint))
    view = GpuView(gpu_id(cand.name, device), gpu.usable, gpu.room(policy), tuple(occupants))
    return Room(max(0, room - own), view, models)
