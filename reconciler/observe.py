"""Observation: agent snapshots, read through a short cache, turned into planning Candidates.

Each reconcile reads the world here. ``SnapshotCache`` fetches an agent's snapshot at most once
per ``ttl`` (100 ms) however many reconciles ask, and concurrent askers share one request in
flight; a caller that must see the present (before a sleep, after an event) asks for a
``fresh`` one. An agent that does not answer keeps its last snapshot, marked unhealthy, so a
network blip does not make every claim on it look lost.

``candidate`` is pure: an agent's snapshot, its pool and the claims' perGPU figures become the
planners' ``Candidate`` (labels from the pool definition, healthy = the snapshot answered, GPUs
from the accelerators' usable bytes, residents from the models). An engine that answers to no
known claim is foreign: the planners place nothing beside it.

``IdleTracker`` remembers when each engine was last busy (requests running or waiting, a new
finished request, or a phase change such as becoming active), for the sleep policy.
``Reservations`` account for activations and wakes the snapshots do not show yet, so two
concurrent reconciles never spend the same room.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from agent_client import AgentApi, AgentUnreachable
from contract.clock import Clock
from reconciler.desired import ClaimKey
from reconciler.model.manifests import AgentRef, PerGPU, WarmPool
from reconciler.planning.state import Candidate, EngineState, Gpu, Resident

log = logging.getLogger("reconciler.observe")

SNAPSHOT_TTL_S = 0.1
RESERVATION_TTL_S = 120.0
_STARTING = frozenset({"activating", "booting", "restarting", "stopping"})


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    number = _num(value)
    return int(number) if number is not None else None


@dataclass(frozen=True)
class EngineObs:
    """One engine as its agent's snapshot shows it."""

    model_name: str
    engine: str
    phase: str
    claim_ref: ClaimKey | None = None
    engine_id: str = ""
    port: int = 0
    ready: bool = False
    operation: str | None = None
    restart_count: int = 0
    last_error: str | None = None
    running: float | None = None
    waiting: float | None = None
    success_total: float | None = None
    kv_requested: int | None = None
    kv_applied: int | None = None
    kv_used: int | None = None
    kv_present: bool = False
    kv_not_held: bool = False
    hbm_bytes: int | None = None
    hbm_peak: int | None = None
    sleeping_footprint: int | None = None
    devices: tuple[int, ...] = ()

    @property
    def load(self) -> float | None:
        if self.running is None or self.waiting is None:
            return None
        return self.running + self.waiting

    @classmethod
    def from_entry(cls, m: Mapping[str, Any]) -> EngineObs:
        ref = m.get("claim_ref")
        claim_ref = None
        if isinstance(ref, Mapping) and ref.get("name"):
            claim_ref = (str(ref.get("namespace") or "default"), str(ref["name"]))
        segment = m.get("kv_segment")
        return cls(
            model_name=str(m["model_name"]), engine=str(m.get("engine", "vllm")),
            phase=str(m.get("phase", "")), claim_ref=claim_ref,
            engine_id=str(m.get("engine_id", "")), port=_int(m.get("port")) or 0,
            ready=bool(m.get("ready")), operation=m.get("operation") or None,
            restart_count=_int(m.get("restart_count")) or 0, last_error=m.get("last_error"),
            running=_num(m.get("requests_running")), waiting=_num(m.get("requests_waiting")),
            success_total=_num(m.get("request_success_total")),
            kv_requested=_int(m.get("kv_limit_requested_bytes")),
            kv_applied=_int(m.get("kv_limit_applied_bytes")), kv_used=_int(m.get("kv_used_bytes")),
            kv_present=isinstance(segment, Mapping) and bool(segment.get("present")),
            kv_not_held="KVLimitNotHeld" in (m.get("conditions") or ()),
            hbm_bytes=_int(m.get("hbm_bytes")), hbm_peak=_int(m.get("hbm_peak_bytes")),
            sleeping_footprint=_int(m.get("sleeping_footprint_bytes")),
            devices=tuple(int(d) for d in m.get("devices") or ()))


@dataclass(frozen=True)
class GpuObs:
    index: int
    usable: int
    other: int  # bytes held by processes that are no engine's


@dataclass(frozen=True)
class AgentObs:
    """An agent's last snapshot. ``ok``: the latest fetch answered; ``fetched_at``: when the
    latest fetch was tried; ``seen_at``: when one last answered (None: never)."""

    name: str
    ok: bool
    fetched_at: float
    seen_at: float | None = None
    error: str | None = None
    gpus: tuple[GpuObs, ...] = ()
    engines: tuple[EngineObs, ...] = ()
    cached_artifacts: frozenset[str] = frozenset()
    first_at: float | None = None  # when this reconciler first asked the agent
    staging_artifacts: frozenset[str] = frozenset()
    body: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def silent_since(self) -> float | None:
        """Since when the agent has not answered (None: it answers)."""
        if self.ok:
            return None
        return self.seen_at if self.seen_at is not None else self.first_at

    def engine(self, model_name: str) -> EngineObs | None:
        return self._by_model.get(model_name)

    @cached_property
    def _by_model(self) -> dict[str, EngineObs]:
        out: dict[str, EngineObs] = {}
        for e in self.engines:
            out.setdefault(e.model_name, e)
        return out

    @cached_property
    def by_claim(self) -> Mapping[ClaimKey, tuple[EngineObs, ...]]:
        """The engines that answer to each claim (built once per snapshot: a reconcile looks
        its claim up on every agent, so a scan of every engine would cost claims x engines)."""
        out: dict[ClaimKey, list[EngineObs]] = {}
        for e in self.engines:
            if e.claim_ref is not None and e.phase != "stopped":
                out.setdefault(e.claim_ref, []).append(e)
        return {k: tuple(v) for k, v in out.items()}

    @classmethod
    def parse(cls, name: str, snap: Mapping[str, Any], at: float) -> AgentObs:
        gpus = []
        for acc in snap.get("accelerators") or ():
            usable = _int(acc.get("hbm_usable_bytes")) or _int(acc.get("hbm_total_bytes")) or 0
            used = _int(acc.get("hbm_used_bytes")) or 0
            by_engines = _int(acc.get("hbm_used_by_engines_bytes")) or 0
            gpus.append(GpuObs(int(acc["index"]), usable, max(0, used - by_engines)))
        engines = tuple(EngineObs.from_entry(m) for m in snap.get("models") or ()
                        if isinstance(m, Mapping) and "model_name" in m)
        return cls(name, True, at, at, None, tuple(sorted(gpus, key=lambda g: g.index)), engines,
                   frozenset(str(a) for a in snap.get("cached_artifacts") or ()),
                   staging_artifacts=frozenset(str(a) for a in snap.get("artifacts_staging")
                                               or ()), body=snap)


class IdleTracker:
    """When each engine (agent, model) was last busy, from the snapshots seen."""

    def __init__(self) -> None:
        # by agent, then model (a snapshot replaces one agent's entries: a scan of every
        # engine of the fleet per snapshot cost 10% of a 10,000-claim reconciler's CPU)
        self._seen: dict[str, dict[str, tuple[str, str, float | None, float]]] = {}

    def observe(self, obs: AgentObs) -> None:
        before = self._seen.get(obs.name, {})
        after: dict[str, tuple[str, str, float | None, float]] = {}
        for e in obs.engines:
            prev = before.get(e.model_name)
            busy = (prev is None or prev[0] != e.engine_id or prev[1] != e.phase
                    or e.phase != "active" or (e.load or 0) > 0
                    or (e.success_total or 0) > (prev[2] or 0))
            last = obs.fetched_at if busy or prev is None else prev[3]
            after[e.model_name] = (e.engine_id, e.phase, e.success_total, last)
        if after:
            self._seen[obs.name] = after
        else:
            self._seen.pop(obs.name, None)

    def busy(self, agent: str, model: str, now: float) -> None:
        """Count the engine busy now (it just woke or took a request)."""
        prev = self._seen.get(agent, {}).get(model)
        if prev is not None:
            self._seen[agent][model] = (prev[0], prev[1], prev[2], now)

    def last_busy(self, agent: str, model: str) -> float | None:
        prev = self._seen.get(agent, {}).get(model)
        return prev[3] if prev else None


class SnapshotCache:
    """Snapshots per agent, fetched at most once per ``ttl`` and shared by concurrent callers.

    ``invalidate`` starts a new generation: reads after it never get a snapshot whose fetch
    began before it."""

    def __init__(self, clients: Callable[[str], AgentApi | None], clock: Clock, *,
                 ttl: float = SNAPSHOT_TTL_S,
                 on_snapshot: Callable[[AgentObs], None] | None = None) -> None:
        self._clients = clients
        self._clock = clock
        self._ttl = ttl
        self._on_snapshot = on_snapshot
        self._last: dict[str, tuple[AgentObs, int]] = {}
        self._gen: dict[str, int] = {}
        self._flight: dict[str, tuple[float, int, asyncio.Future[AgentObs]]] = {}
        self.fetches = 0

    def last(self, agent: str) -> AgentObs | None:
        entry = self._last.get(agent)
        return entry[0] if entry else None

    def peek(self, agent: str, max_age: float | None = None) -> AgentObs | None:
        """The cached snapshot if ``get`` would answer it without a fetch, else None (no
        await: a reconcile reads a thousand agents' cached snapshots without a task each)."""
        age = self._ttl if max_age is None else max_age
        entry = self._last.get(agent)
        if entry is not None and entry[1] == self._gen.get(agent, 0) \
                and self._clock.now() - entry[0].fetched_at <= age:
            return entry[0]
        return None

    def forget(self, agent: str) -> None:
        """The agent left every pool: drop what is cached for it."""
        self._last.pop(agent, None)
        self._gen.pop(agent, None)

    def invalidate(self, agent: str) -> None:
        """The agent changed (an event, our own call): the next read fetches again."""
        self._gen[agent] = self._gen.get(agent, 0) + 1

    async def fresh(self, agent: str) -> AgentObs:
        """A snapshot whose fetch starts now (shared only with callers asking after this)."""
        self.invalidate(agent)
        return await self.get(agent)

    async def get(self, agent: str, max_age: float | None = None) -> AgentObs:
        age = self._ttl if max_age is None else max_age
        now = self._clock.now()
        gen = self._gen.get(agent, 0)
        entry = self._last.get(agent)
        if entry is not None and entry[1] == gen and now - entry[0].fetched_at <= age:
            return entry[0]
        flight = self._flight.get(agent)
        if flight is not None and flight[1] == gen and now - flight[0] <= age:
            return await asyncio.shield(flight[2])
        future: asyncio.Future[AgentObs] = asyncio.get_running_loop().create_future()
        self._flight[agent] = (now, gen, future)
        try:
            result = await self._fetch(agent, now, gen)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as err:  # a bug: the sharers get it too, and nobody hangs
            future.set_exception(err)
            future.exception()
            raise
        finally:
            if agent in self._flight and self._flight[agent][2] is future:
                del self._flight[agent]
        future.set_result(result)
        return result

    async def _fetch(self, agent: str, started: float, gen: int) -> AgentObs:
        client = self._clients(agent)
        prev = self.last(agent)
        self.fetches += 1
        try:
            if client is None:
                raise AgentUnreachable(f"agent {agent} is not in any pool")
            body = await client.snapshot()
            if prev is not None and prev.ok and body is prev.body:
                # the agent answered "not modified": the same snapshot, seen now
                obs = replace(prev, fetched_at=started, seen_at=started)
            else:
                obs = replace(AgentObs.parse(agent, body, started),
                              first_at=prev.first_at if prev else started)
        except (AgentUnreachable, KeyError, TypeError, ValueError) as err:
            if prev is None or prev.ok:
                log.warning("agent %s: snapshot failed: %s", agent, err)
            obs = AgentObs(agent, False, started, prev.seen_at if prev else None, str(err),
                           prev.gpus if prev else (), prev.engines if prev else (),
                           prev.cached_artifacts if prev else frozenset(),
                           prev.first_at if prev else started)
        else:
            if self._on_snapshot is not None:
                self._on_snapshot(obs)
        current = self._last.get(agent)
        if current is None or (current[1], current[0].fetched_at) <= (gen, started):
            self._last[agent] = (obs, gen)
        return obs


@dataclass(frozen=True)
class Reservation:
    """Room an activation or a wake holds before the snapshots show it."""

    agent: str
    model: str
    resident: Resident
    devices: tuple[int, ...]
    kind: str  # "activate" | "wake"
    at: float


class Reservations:
    def __init__(self, ttl: float = RESERVATION_TTL_S) -> None:
        self._ttl = ttl
        self._by_agent: dict[str, dict[str, Reservation]] = {}
        self._versions: dict[str, int] = {}

    def version(self, agent: str) -> int:
        """Changes whenever the agent's reservations do (the room index rebuilds it then)."""
        return self._versions.get(agent, 0)

    def _changed(self, agent: str) -> None:
        self._versions[agent] = self._versions.get(agent, 0) + 1

    def add(self, reservation: Reservation) -> None:
        self._by_agent.setdefault(reservation.agent, {})[reservation.model] = reservation
        self._changed(reservation.agent)

    def drop(self, agent: str, model: str) -> None:
        held = self._by_agent.get(agent)
        if held is not None:
            if held.pop(model, None) is not None:
                self._changed(agent)
            if not held:
                del self._by_agent[agent]

    def agents_for(self, model: str) -> set[str]:
        """Agents holding a reservation for ``model``."""
        return {agent for agent, held in self._by_agent.items() if model in held}

    def live(self, obs: AgentObs) -> list[Reservation]:
        """The agent's reservations its snapshot does not show yet (others are dropped)."""
        held = self._by_agent.get(obs.name)
        if not held:
            return []
        out = []
        for model, res in list(held.items()):
            engine = obs.engine(res.model)
            seen = engine is not None and (res.kind == "activate" or engine.phase != "sleeping")
            if (obs.ok and obs.fetched_at > res.at and seen) or obs.fetched_at - res.at > self._ttl:
                del held[model]
                self._changed(obs.name)
            else:
                out.append(res)
        if not held:
            del self._by_agent[obs.name]
        return out


def resident_state(engine: EngineObs) -> EngineState | None:
    """How the planners count an engine; None: it holds nothing (failed, stopped)."""
    if engine.phase == "active":
        return EngineState.AWAKE
    if engine.phase == "sleeping":
        return EngineState.STARTING if engine.operation == "wake" else EngineState.ASLEEP
    if engine.phase in _STARTING:
        return EngineState.STARTING
    return None


def candidate(obs: AgentObs, agent: AgentRef, pool: WarmPool,
              per_gpu: Callable[[ClaimKey], PerGPU | None],
              last_busy: Callable[[str], float | None],
              reservations: Sequence[Reservation] = (),
              make_room_after: Callable[[ClaimKey], float | None] = lambda key: None,
              unmeasured: Callable[[ClaimKey], bool] = lambda key: False
              ) -> Candidate:
    """The planners' view of one agent. ``per_gpu``: a claim's figures (None: unknown, so its
    engine is foreign, unless ``unmeasured`` says its claim was placed to be measured: then it
    holds its GPUs whole, ``state.Gpu.room``); ``last_busy``: by model name;
    ``make_room_after``: a claim's own idle time before it may be slept for room (None: the
    pool's)."""
    placed: dict[int, list[Resident]] = {g.index: [] for g in obs.gpus}
    other = {g.index: g.other for g in obs.gpus}
    foreign: list[str] = []
    for e in obs.engines:
        state = resident_state(e)
        if state is None:
            continue
        figures = per_gpu(e.claim_ref) if e.claim_ref is not None else None
        devices = [d for d in e.devices if d in placed] or list(placed)
        to_measure = figures is None and e.claim_ref is not None and unmeasured(e.claim_ref)
        if figures is None and not to_measure:
            foreign.append(e.model_name)
            for d in devices:
                other[d] += e.hbm_bytes or 0
            continue
        footprint, kv_floor = (figures.maximum_footprint, figures.kv_floor) if figures \
            else ((e.hbm_bytes or 0) // max(1, len(devices)), 0)
        resident = Resident(e.model_name, footprint, kv_floor, state,
                            e.running, e.waiting, last_busy(e.model_name), e.kv_used,
                            e.kv_requested, e.sleeping_footprint, e.engine == "vllm",
                            make_room_after(e.claim_ref) if e.claim_ref is not None else None,
                            unmeasured=to_measure)
        for d in devices:
            placed[d].append(resident)
    gpus = tuple(Gpu(g.index, g.usable, tuple(placed[g.index]), other[g.index]) for g in obs.gpus)
    result = Candidate(agent.name, gpus, agent.labels, pool.namespace, obs.ok,
                       obs.cached_artifacts, pool.policy, obs.fetched_at, tuple(foreign),
                       obs.staging_artifacts)
    for res in reservations:
        result = result.with_resident(res.resident, res.devices)
    return result


class LazyCandidates(Mapping[str, Candidate]):
    """Candidates built on first use, once per World: a reconcile that follows its engine
    reads one agent's candidate, and only a placement reads them all."""

    def __init__(self, names: Sequence[str], build: Callable[[str], Candidate]) -> None:
        self._names = {n: None for n in names}
        self._build = build
        self._built: dict[str, Candidate] = {}

    def __getitem__(self, name: str) -> Candidate:
        if name not in self._names:
            raise KeyError(name)
        cand = self._built.get(name)
        if cand is None:
            cand = self._built[name] = self._build(name)
        return cand

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True)
class World:
    """What one reconcile sees: every agent's observation and candidate, at ``now``."""

    now: float
    agents: Mapping[str, AgentObs]
    candidates: Mapping[str, Candidate]
    urls: Mapping[str, str] = field(default_factory=dict)

    def engines_of(self, key: ClaimKey) -> list[tuple[str, EngineObs]]:
        """Every engine, on any agent, that answers to the claim ``key``."""
        return [(name, e) for name, obs in sorted(self.agents.items())
                for e in obs.by_claim.get(key, ())]

    def candidate_list(self) -> list[Candidate]:
        return [self.candidates[name] for name in sorted(self.candidates)]
