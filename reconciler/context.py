"""What the claim and KV reconcilers share: settings, the stores, and how they read the world.

``Deps`` is built once by the app (``reconciler.app``) and by tests with fakes: the clock, the
desired state, the status store, the agent clients, the snapshot cache and the small books
(idle times, reservations, route holds, wake requests). ``world`` reads every agent's snapshot
through the cache and turns each into a planning ``Candidate``; ``kick_*`` put keys back on the
controllers' queues (room may have appeared, a KV division is due). ``in_flight`` counts the
requests the front door (``reconciler.door``) holds or forwards per model: such a model is busy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from reconciler.client import AgentApi
from reconciler.desired import ClaimKey, DesiredState
from reconciler.metrics import ClaimMetrics
from reconciler.model.manifests import PerGPU, WarmPool
from reconciler.observe import (
    AgentObs,
    IdleTracker,
    Reservations,
    SnapshotCache,
    World,
    candidate,
)
from reconciler.planning.state import Candidate
from reconciler.routes import RouteHolds, WakeBook, WakeRequest
from reconciler.runtime.clock import Clock
from reconciler.status import (
    ACTIVATE_FAILED,
    ENGINE_FAILED,
    MAKING_ROOM,
    NO_MATCHING_PODS,
    PENDING,
    READY,
    SCHEDULED,
    WAITING_FOR_ROOM,
)
from reconciler.store import StatusStore


@dataclass(frozen=True)
class Timings:
    """The reconciler's waits, in seconds (the guide's where it gives them)."""

    drain_timeout: float = 90.0  # a deleted claim's engine may finish requests this long
    unreachable_grace: float = 30.0  # an agent silent this long has lost its engines
    starting_poll: float = 10.0  # look again at a starting engine (events usually come first)
    settle_poll: float = 0.25  # look again while a sleep made for room settles
    settle_timeout: float = 10.0  # stop waiting for a sleeping footprint to be measured
    kv_resync: float = 5.0  # re-divide an agent's GPUs this often while engines are awake
    kv_gate_poll: float = 0.5  # look again at an engine waiting for its KV limit
    max_snapshot_age: float = 30.0


@dataclass
class Deps:
    clock: Clock
    wall: Callable[[], float]
    desired: DesiredState
    store: StatusStore
    clients: Callable[[str], AgentApi | None]
    cache: SnapshotCache
    tracker: IdleTracker = field(default_factory=IdleTracker)
    reservations: Reservations = field(default_factory=Reservations)
    holds: RouteHolds = field(default_factory=RouteHolds)
    wakes: WakeBook = field(default_factory=WakeBook)
    metrics: ClaimMetrics | None = None
    timings: Timings = field(default_factory=Timings)
    kick_kv: Callable[[str], None] = lambda agent: None
    kick_claim: Callable[[ClaimKey], None] = lambda key: None
    # requests in flight through the front door, by model: such a model is busy (never slept)
    in_flight: Callable[[str], int] = lambda model: 0

    # ---- reading the world ----------------------------------------------------------------

    def per_gpu(self, key: ClaimKey) -> PerGPU | None:
        """A claim's perGPU: the manifest's, else the last valid one its status kept (a claim
        being deleted, or one whose perGPU became invalid while its engine runs)."""
        claim = self.desired.claim(key)
        if claim is not None and claim.per_gpu is not None:
            return claim.per_gpu
        st = self.store.get(key)
        if st is not None and st.per_gpu is not None:
            return PerGPU(*st.per_gpu)
        return None

    def _last_busy_on(self, agent: str) -> Callable[[str], float | None]:
        return lambda model: self.tracker.last_busy(agent, model)

    def candidate_of(self, obs: AgentObs, reserved: bool = True) -> Candidate | None:
        for agent, pool in self.desired.agents():
            if agent.name == obs.name:
                return candidate(obs, agent, pool, self.per_gpu, self._last_busy_on(obs.name),
                                 self.reservations.live(obs) if reserved else ())
        return None

    async def world(self, max_age: float | None = None, fresh: bool = False) -> World:
        """Every pool agent's snapshot (through the cache; ``fresh``: fetched now) and
        candidate."""
        agents = self.desired.agents()
        if fresh:
            for agent, _ in agents:
                self.cache.invalidate(agent.name)
        observed = await asyncio.gather(*(self.cache.get(a.name, max_age) for a, _ in agents))
        candidates = {}
        for (agent, pool), obs in zip(agents, observed, strict=True):
            candidates[agent.name] = candidate(obs, agent, pool, self.per_gpu,
                                               self._last_busy_on(agent.name),
                                               self.reservations.live(obs))
        return World(self.clock.now(), {o.name: o for o in observed}, candidates,
                     {a.name: a.url for a, _ in agents})

    def pool_of(self, agent: str) -> WarmPool | None:
        return self.desired.pool_of(agent)

    def client(self, agent: str) -> AgentApi:
        client = self.clients(agent)
        if client is None:
            raise LookupError(f"agent {agent} is in no pool")
        return client

    # ---- room may have appeared -------------------------------------------------------------

    def waiting_keys(self) -> list[ClaimKey]:
        """Claims that wait for room: Pending (other than for a reason waiting cannot fix),
        making room, waiting to wake, failed and hoping to move, refused by an agent."""
        out = []
        for st in self.store.all():
            if st.deleted is not None:
                continue
            sched, ready = st.reason(SCHEDULED), st.reason(READY)
            if (st.phase == PENDING and sched in (NO_MATCHING_PODS, MAKING_ROOM, "")) \
                    or ready in (WAITING_FOR_ROOM, ENGINE_FAILED, ACTIVATE_FAILED):
                out.append(st.key)
        return out

    def ask_wake(self, model: str, key: ClaimKey) -> tuple[WakeRequest, bool]:
        """Record a wake request for ``model`` (repeats collapse into the first) and look at its
        claim now if it is new; (the request, whether it is new)."""
        req, new = self.wakes.request(model, key, self.clock.now(), self.wall())
        if new:
            self.kick_claim(key)
        return req, new

    def kick_waiting(self) -> None:
        for key in self.waiting_keys():
            self.kick_claim(key)

    def event_keys(self, agent: str, event: dict[str, object]) -> list[ClaimKey]:
        """An agent's engine event: the claims to look at again (and a KV division)."""
        self.cache.invalidate(agent)
        if event.get("kind") == "artifact":
            return []  # a weight-cache entry changed: the next snapshot shows it
        model, src, dst = str(event.get("model", "")), event.get("from"), event.get("to")
        keys: list[ClaimKey] = []
        key = self.desired.by_model(model) or next(
            (st.key for st in self.store.all() if st.model_name == model), None)
        if key is not None and event.get("reason") != "KVLimitSet":
            keys.append(key)
        if src != dst:
            self.kick_kv(agent)
            if dst in ("sleeping", "stopped", "failed"):
                keys.extend(k for k in self.waiting_keys() if k not in keys)
        return keys
