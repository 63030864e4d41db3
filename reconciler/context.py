"""What the claim and KV reconcilers share: how they read the world, and the books they keep.

``Deps`` is built once by the core (``reconciler.core``) and by tests with fakes, in two halves:

* ``WorldReader`` reads what others own: the clock, the desired state, the agent clients, the
  snapshot cache and the door's requests in flight (``in_flight``: such a model is busy); and
  the status store, where the claims' statuses are reported to the world (files, or the
  Kubernetes status subresource). ``world`` reads every agent's snapshot through the cache
  and turns each into a planning ``Candidate`` (reading the reservations and idle times of the
  books); ``rooms`` is the room index over those.
* ``Books`` holds what the reconciler itself writes down between reconciles: idle times,
  reservations, route holds, wake and release requests, the claims' metrics, and the ways it
  asks for another look (``kick_*`` put keys back on the controllers' queues: room may have
  appeared, a KV division is due) or publishes a route (``routes_out``).

The reconcilers, the door and the Kubernetes route publisher keep them as ``self.w`` (the
world reader) and ``self.b`` (the books), so each line says which of the two it touches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from agent_client import AgentApi
from contract.clock import Clock
from reconciler.desired import ClaimKey, Desired
from reconciler.metrics import ClaimMetrics
from reconciler.model.manifests import AgentRef, PerGPU, WarmPool
from reconciler.observe import (
    AgentObs,
    IdleTracker,
    LazyCandidates,
    Reservations,
    SnapshotCache,
    World,
    candidate,
)
from reconciler.planning.state import Candidate
from reconciler.release_book import ReleaseBook, ReleaseRequest
from reconciler.replicas import REPLICA_NEEDS_ANOTHER_POD
from reconciler.room_book import RoomBook
from reconciler.routes import RouteHolds, WakeBook, WakeRequest
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
    kv_resync: float = 5.0  # re-divide an agent's GPUs this often while engines take requests
    kv_idle_resync: float = 60.0  # ... and this often while they are all idle (no request)
    # Snapshots of agents a reconcile does not act on (other than its claim's own agent) may be
    # this old unless an event or a call of ours made them stale; None: the cache's ttl.
    others_max_age: float | None = None
    kv_gate_poll: float = 0.5  # look again at an engine waiting for its KV limit
    max_snapshot_age: float = 30.0


async def _routes_read_live(model: str) -> bool:
    return True


@dataclass
class Books:
    """What the reconciler writes down itself, and how it asks for another look: every field is
    the reconciler's own (the world's state is read through ``WorldReader``)."""

    clock: Clock  # requests are stamped with it (monotonic, and wall time for statuses)
    tracker: IdleTracker = field(default_factory=IdleTracker)
    reservations: Reservations = field(default_factory=Reservations)
    holds: RouteHolds = field(default_factory=RouteHolds)
    wakes: WakeBook = field(default_factory=WakeBook)
    releases: ReleaseBook = field(default_factory=ReleaseBook)  # the door's release route
    metrics: ClaimMetrics | None = None
    kick_kv: Callable[[str], None] = lambda agent: None
    kick_claim: Callable[[ClaimKey], None] = lambda key: None
    # Make a model's route as the books say now, before acting on it (a hold taken before a
    # sleep): True once readers see it. The HTTP route table reads the books on every request;
    # on Kubernetes the Pod's route annotation is patched first.
    routes_out: Callable[[str], Awaitable[bool]] = _routes_read_live

    def ask_wake(self, model: str, key: ClaimKey, victims: tuple[str, ...] = ()
                 ) -> tuple[WakeRequest, bool]:
        """Record a wake request for ``model`` (repeats collapse into the first) and look at its
        claim now if it is new or now names ``victims`` (models to sleep first for its room);
        (the request, whether it is new)."""
        old = self.wakes.get(model)
        named = old.victims if old is not None else ()
        req, new = self.wakes.request(model, key, self.clock.now(), self.clock.wall(), victims)
        if new or req.victims != named:
            self.kick_claim(key)
        return req, new

    def ask_release(self, model: str, key: ClaimKey) -> ReleaseRequest:
        """Record a request to put ``model`` to sleep now (``reconciler.release_book``) and look
        at its claim now."""
        req = self.releases.ask(model, self.clock.now())
        self.kick_claim(key)
        return req

    def kick_claims(self, keys: Iterable[ClaimKey]) -> None:
        for key in keys:
            self.kick_claim(key)


@dataclass
class WorldReader:
    """What the reconciler reads and does not own: the clock, the desired state, the agents
    (through the snapshot cache), the door's requests in flight, and the status store its
    reports go to; the books are read too (reservations and idle times shape a candidate),
    never written here."""

    clock: Clock  # monotonic time for waits and ages, wall time for what statuses carry
    desired: Desired
    store: StatusStore
    clients: Callable[[str], AgentApi | None]
    cache: SnapshotCache
    books: Books
    timings: Timings = field(default_factory=Timings)
    # requests in flight through the front door, by model: such a model is busy (never slept)
    in_flight: Callable[[str], int] = lambda model: 0
    # when a new call to a claim could start on one of its serving replicas, by the door's
    # figures (seconds; None: none serves, or no door): copies by demand read it
    queue_wait: Callable[[ClaimKey], float | None] = lambda key: None
    _candidates: dict[str, tuple[AgentObs, Any, Candidate]] = field(default_factory=dict)
    rooms: RoomBook = field(init=False)

    def __post_init__(self) -> None:
        self.rooms = RoomBook(self.desired.agent, self.books.reservations.version,
                              self._candidate, self.figures)

    def wall(self) -> float:
        """Seconds since the epoch on the clock: what statuses and events carry."""
        return self.clock.wall()

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

    def figures(self, key: ClaimKey) -> tuple[PerGPU | None, bool]:
        """What an engine of the claim counts for in a candidate: its perGPU, and whether it
        is being measured (the room book rebuilds an agent's entry when either changes)."""
        return self.per_gpu(key), self.unmeasured(key)

    def unmeasured(self, key: ClaimKey) -> bool:
        """The claim was placed to be measured and has no figures yet."""
        claim = self.desired.claim(key)
        return claim is not None and claim.to_measure

    def make_room_after(self, key: ClaimKey) -> float | None:
        """A claim's own idle time before its engine may be slept for room (None: the pool's)."""
        claim = self.desired.claim(key)
        return claim.lifecycle.make_room_after if claim is not None and claim.lifecycle else None

    def _last_busy_on(self, agent: str) -> Callable[[str], float | None]:
        return lambda model: self.books.tracker.last_busy(agent, model)

    def _candidate(self, obs: AgentObs, agent: AgentRef, pool: WarmPool) -> Candidate:
        """``candidate``, reused while nothing it reads changed (the snapshot, the pool, the
        engines' perGPU and idle times, the reservations): a placement reads every agent's,
        and building a thousand of them per placement was most of a fleet's placement cost."""
        live = self.books.reservations.live(obs)
        busy = self._last_busy_on(obs.name)
        key = (agent, pool, tuple(live),
               tuple((self.per_gpu(e.claim_ref), self.make_room_after(e.claim_ref),
                      busy(e.model_name), self.unmeasured(e.claim_ref))
                     if e.claim_ref is not None else (None, None, None, False)
                     for e in obs.engines))
        cached = self._candidates.get(obs.name)
        if cached is not None and cached[1] == key and (cached[0] is obs or (
                obs.body is not None and cached[0].body is obs.body and cached[0].ok == obs.ok)):
            made = cached[2]
            if made.observed_at != obs.fetched_at:  # the same snapshot, seen again (304)
                made = replace(made, observed_at=obs.fetched_at)
                self._candidates[obs.name] = (obs, key, made)
            return made
        made = candidate(obs, agent, pool, self.per_gpu, busy, live, self.make_room_after,
                         self.unmeasured)
        self._candidates[obs.name] = (obs, key, made)
        return made

    def planned_view(self, obs: AgentObs) -> Candidate | None:
        """The planners' candidate for the agent ``obs`` observed, with the live reservations
        (the one a reconcile builds, reused while nothing it reads changed); None for an agent
        of no pool. What the door reads when it weighs making room (``door.room``)."""
        found = self.desired.agent(obs.name)
        return None if found is None else self._candidate(obs, *found)

    def candidate_of(self, obs: AgentObs, reserved: bool = True) -> Candidate | None:
        found = self.desired.agent(obs.name)
        if found is None:
            return None
        agent, pool = found
        live = self.books.reservations.live(obs) if reserved else ()
        return candidate(obs, agent, pool, self.per_gpu, self._last_busy_on(obs.name), live,
                         self.make_room_after, self.unmeasured)

    async def world(self, max_age: float | None = None, fresh: bool = False,
                    focus: Collection[str] = (), placing: bool = False) -> World:
        """Every pool agent's snapshot (through the cache; ``fresh``: fetched now) and
        candidate (built when first read). ``focus``: the agents the reconcile acts on, read
        within ``max_age`` (the cache's ttl). With ``others_max_age`` set (the run modes), the
        other agents' cached snapshots serve at any age unless something made them stale (an
        event, a call of ours), and a reconcile that places (``placing``) reads none older than
        ``others_max_age``: following a claim's engine costs one agent's snapshot, not the
        fleet's. Cached snapshots are read without a task per agent."""
        agents = self.desired.agents()
        if fresh:
            for agent, _ in agents:
                self.cache.invalidate(agent.name)
        others = self.timings.others_max_age
        if others is None:
            other_age = max_age
        elif placing:
            other_age = max(others, max_age or 0.0)
        else:
            other_age = float("inf")
        observed: dict[str, AgentObs] = {}
        missing: list[str] = []
        for agent, _ in agents:
            age = max_age if agent.name in focus else other_age
            obs = self.cache.peek(agent.name, age)
            if obs is None:
                missing.append(agent.name)
            else:
                observed[agent.name] = obs
        if missing:
            fetched = await asyncio.gather(*(self.cache.get(
                name, max_age if name in focus else other_age) for name in missing))
            observed.update(zip(missing, fetched, strict=True))
        refs = {a.name: (a, p) for a, p in agents}

        def build(name: str) -> Candidate:
            agent, pool = refs[name]
            return self._candidate(observed[name], agent, pool)

        names = [a.name for a, _ in agents]
        return World(self.clock.now(), {n: observed[n] for n in names},
                     LazyCandidates(names, build), {a.name: a.url for a, _ in agents})

    def pool_of(self, agent: str) -> WarmPool | None:
        return self.desired.pool_of(agent)

    def client(self, agent: str) -> AgentApi:
        client = self.clients(agent)
        if client is None:
            raise LookupError(f"agent {agent} is in no pool")
        return client

    def waiting_keys(self) -> list[ClaimKey]:
        """Claims that wait for room: Pending (other than for a reason waiting cannot fix),
        making room, waiting to wake, failed and hoping to move, refused by an agent."""
        out = []
        for st in self.store.values():
            if st.deleted is not None:
                continue
            sched, ready = st.reason(SCHEDULED), st.reason(READY)
            if (st.phase == PENDING and sched in (NO_MATCHING_PODS, MAKING_ROOM,
                                                  REPLICA_NEEDS_ANOTHER_POD, "")) \
                    or ready in (WAITING_FOR_ROOM, ENGINE_FAILED, ACTIVATE_FAILED):
                out.append(st.key)
        return sorted(out)


@dataclass(frozen=True)
class Deps:
    """The two halves the reconcilers are given: ``reader`` (reads) and ``books`` (writes)."""

    reader: WorldReader
    books: Books

    @classmethod
    def build(cls, clock: Clock, desired: Desired,
              store: StatusStore, clients: Callable[[str], AgentApi | None],
              cache: SnapshotCache, *, tracker: IdleTracker | None = None,
              metrics: ClaimMetrics | None = None, timings: Timings | None = None,
              kick_kv: Callable[[str], None] = lambda agent: None,
              kick_claim: Callable[[ClaimKey], None] = lambda key: None,
              in_flight: Callable[[str], int] = lambda model: 0) -> Deps:
        books = Books(clock, tracker=IdleTracker() if tracker is None else tracker,
                      metrics=metrics, kick_kv=kick_kv, kick_claim=kick_claim)
        return cls(WorldReader(clock, desired, store, clients, cache, books,
                               timings=Timings() if timings is None else timings,
                               in_flight=in_flight), books)

    def event_keys(self, agent: str, event: dict[str, object]) -> list[ClaimKey]:
        """An agent's engine event: the claims to look at again (and a KV division)."""
        self.reader.cache.invalidate(agent)
        if event.get("kind") == "artifact":
            return []  # a weight-cache entry changed: the next snapshot shows it
        model, src, dst = str(event.get("model", "")), event.get("from"), event.get("to")
        keys: list[ClaimKey] = []
        key = self.reader.desired.by_model(model) or self.reader.store.by_model(model)
        if key is not None and event.get("reason") != "KVLimitSet":
            keys.append(key)
        if src != dst:
            self.books.kick_kv(agent)
            if dst in ("sleeping", "stopped", "failed"):
                keys.extend(k for k in self.reader.waiting_keys() if k not in keys)
        return keys
