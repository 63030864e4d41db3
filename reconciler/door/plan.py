"""What the door does with a request, per call: forward it, hold it, or refuse it (pure).

The reconciler already says where each claim's model serves: its status (phase and the
``Scheduled``/``Ready`` reasons) and its route (``reconciler.routes.route_of``: a port only while
the claim is Active, its agent answers and no sleep is being prepared for it). ``decide`` turns
that into the door's answer for one claim:

| the claim | the door |
|---|---|
| Active and on the route | forward to the route's host and port |
| Active, off the route (a sleep being prepared, the agent not answering) | hold (``settle``) |
| Sleeping | hold and ask for a wake (``wake``); ``room`` once it waits for room to wake |
| Activating (starting, waking, restarting) | hold (``start``) |
| Pending for room (``NoMatchingPods``, ``MakingRoom``, not placed yet) | hold and kick it (``room``) |
| Failed and ``Moving``, or ``ActivateFailed`` (placement is retried) | hold (``move``, ``start``) |
| held back (``TooLargeForAnyCard``, ``InvalidPerGPU``, ``InvalidEngineConfig``) | refuse: 503, no Retry-After (the guide's: retrying does not help) |
| Failed with ``EngineFailed`` (nowhere to move) | refuse: 503, Retry-After 10 |

A request held past its bound is answered 503 with the guide's Retry-After for the state it
waits in (``RETRY_AFTER``): 10 s while a model starts or wakes, 20 s while room is made, 30 s
while it moves.

``choose`` is the per-call placement among the claims that serve a name (a claim's modelName is
unique, but a LoRA adapter or a served name may be loaded by several): an awake one with the
fewest requests in flight, else the cheapest to make servable (``COST``), ties by claim and
then by replica index, never by load: a held call counts as in flight on the replica it waits
for, so by load the next call of a burst would pick, and wake, another sleeping replica (one
burst woke every replica of a claim; now it wakes replica 0, or the lowest that can wake).
An awake one is passed over for a sleeping (or waking) one only when a new call would wait
longer at every awake one (the seed's queue wait at its engine) than the other takes to wake:
otherwise a copy asleep beside a busy one was never woken by traffic, and a burst queued at
the one awake copy until the idle copy was removed.

``another`` is where a request goes whose engine refused the connection (it never reached it):
another replica of the same claim that serves now (``reconciler.replicas``), if there is one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from reconciler.desired import ClaimKey
from reconciler.replicas import base_key, index_of
from reconciler.routes import Route
from reconciler.status import (
    ACTIVATE_FAILED,
    ACTIVATING,
    ACTIVE,
    ENGINE_FAILED,
    FAILED,
    INVALID_ENGINE_CONFIG,
    INVALID_PER_GPU,
    MOVING,
    PENDING,
    READY,
    SCHEDULED,
    SLEEPING,
    TOO_LARGE,
    WAITING_FOR_ROOM,
    ClaimStatus,
)

# What a held request waits for.
SETTLE, WAKE, ROOM, START, MOVE = "settle", "wake", "room", "start", "move"
RETRY_AFTER = {SETTLE: 10, WAKE: 10, START: 10, ROOM: 20, MOVE: 30}
COST = {SETTLE: 1, START: 2, WAKE: 3, MOVE: 4, ROOM: 5}  # cheaper to make servable first
HELD_BACK = frozenset({TOO_LARGE, INVALID_PER_GPU, INVALID_ENGINE_CONFIG})


@dataclass(frozen=True)
class Forward:
    claim: ClaimKey
    host: str
    port: int
    agent: str


@dataclass(frozen=True)
class Hold:
    claim: ClaimKey
    cause: str  # SETTLE, WAKE, ROOM, START or MOVE
    wake: bool = False  # ask the reconciler for a wake
    kick: bool = False  # ask the reconciler to look at the claim now

    @property
    def retry_after(self) -> int:
        return RETRY_AFTER[self.cause]


@dataclass(frozen=True)
class Refuse:
    claim: ClaimKey
    message: str
    retry_after: int | None  # None: retrying does not help


Decision = Forward | Hold | Refuse


def decide(key: ClaimKey, st: ClaimStatus | None, route: Route | None) -> Decision:
    """The door's answer for a request to claim ``key`` now."""
    if st is None or route is None:  # a claim not looked at yet (or one being deleted)
        return Hold(key, START, kick=True)
    phase, sched, ready = st.phase, st.reason(SCHEDULED), st.reason(READY)
    where = f"model {st.model_name!r} (claim {key[0]}/{key[1]})"
    if phase == ACTIVE:
        if route.state == "active" and route.port > 0:
            return Forward(key, route.host, route.port, route.agent)
        return Hold(key, SETTLE)
    if sched in HELD_BACK or ready in HELD_BACK:
        why = ready if ready in HELD_BACK else sched
        message = st.conditions[READY if ready in HELD_BACK else SCHEDULED].message
        return Refuse(key, f"{where} cannot serve: {why}: {message}", None)
    if phase == SLEEPING:
        return Hold(key, ROOM if ready == WAITING_FOR_ROOM else WAKE, wake=True)
    if phase == ACTIVATING:
        return Hold(key, START)
    if phase == PENDING:
        return Hold(key, ROOM, kick=True)
    if phase == FAILED and ready == MOVING:
        return Hold(key, MOVE)
    if phase == FAILED and ready == ACTIVATE_FAILED:
        return Hold(key, START, kick=True)
    if phase == FAILED and ready == ENGINE_FAILED:
        return Refuse(key, f"{where} failed permanently and has nowhere to move: "
                      f"{st.conditions[READY].message}", RETRY_AFTER[START])
    return Hold(key, START, kick=True)


def choose(decisions: Sequence[Decision], in_flight: Callable[[ClaimKey], int],
           wait: Callable[[ClaimKey], float] | None = None,
           wake: Callable[[ClaimKey], float] | None = None) -> Decision:
    """Per-call placement among the claims serving one name (``decisions`` is not empty): the
    awake claim with the fewest requests in flight, else the held one cheapest to make
    servable (the lowest replica first); a refusal only when every claim refuses.

    ``wait`` (seconds until a new call could start at an awake claim's engine) and ``wake``
    (seconds a sleeping claim takes to wake): with both, a claim asleep or on its way up
    (activating: a wake asked already) is chosen over the awake ones when the shortest wait
    among them is longer than its wake; one on its way first, so a burst converges on it."""
    if len(decisions) == 1:
        return decisions[0]

    def load(d: Decision) -> tuple[int, ClaimKey]:
        return in_flight(d.claim), d.claim

    def cheapest(held: Sequence[Hold]) -> Hold:
        # not by load: a held call counts as in flight on the one it waits for, so the next
        # call of a burst would pick (and wake) another sleeping replica, and each
        return min(held, key=lambda d: (COST[d.cause], base_key(d.claim), index_of(d.claim)))

    awake = [d for d in decisions if isinstance(d, Forward)]
    held = [d for d in decisions if isinstance(d, Hold)]
    if awake:
        coming = [d for d in held if d.cause == WAKE or d.cause == START and not d.kick]
        if coming and wait is not None and wake is not None:  # asleep, or waking already
            woken = cheapest(coming)
            if min(wait(d.claim) for d in awake) > wake(woken.claim):
                return woken
        return min(awake, key=load)
    if held:
        return cheapest(held)
    return min(decisions, key=lambda d: d.claim)


def another(keys: Sequence[ClaimKey], failed: ClaimKey, tried: Collection[ClaimKey],
            decide: Callable[[tuple[ClaimKey, ...]], Decision]) -> Forward | None:
    """Another replica of ``failed``'s claim among ``keys``, not ``tried`` yet, that serves now
    (``decide`` chooses among them as for any call); None when there is none."""
    same = tuple(k for k in keys if base_key(k) == base_key(failed) and k not in tried)
    if not same:
        return None
    d = decide(same)
    return d if isinstance(d, Forward) else None
