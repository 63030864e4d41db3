"""Sleep and wake: idle models asleep, woken models served, room made by sleeping others.

* Idle sleep (the pool's ``sleepAfterSeconds``): ``idle_to_sleep`` names the model; it is taken
  off the route first, figures read from the engine at that moment (the agent's
  ``?fresh=requests``, not its last scrape) must still show no request running or waiting and
  none finished since, and the front door none in flight; only then is it put to sleep
  (level 1) -> Sleeping, event ``Sleeping``. A model that turned busy stays awake and on the route.
* Wake requests (``WakeBook``): a sleeping claim wakes where it is when its GPUs have room for it
  (``victims`` answers []); the agent's own check may still refuse (409
  ``InsufficientGPUMemory``). With ``noWakeReserveWhileAsleep`` the idle models on those GPUs are
  put to sleep, longest idle first and one at a time, re-planning after each once its sleeping
  footprint is measured (``SleptToMakeRoom`` events; the claim reads ``WaitingForRoom``); the
  waking model's whole room is reserved from the first victim on, so no placement or KV grow
  takes what is being made for it. When
  no model can go and another agent has room, the claim moves there (``Moving``); otherwise it
  waits until the request expires (five minutes). The request is removed once the model
  serves, the wake failed, or it expired. One sleep for room at a time per agent: the agent
  settles from the first step until a snapshot fetched after the sleep's answer shows what the
  victim still holds. A wake the agent refuses for memory (it measures; the plan used the
  claims' figures) is asked again; after three refusals the plan includes the agent's
  shortfall, and only then may the claim move. A model that refuses to sleep for room (the
  agent has no host memory for its weights, say) is passed over for a minute. An agent that has
  not measured a victim's sleeping footprint ``settle_timeout`` after its sleep (per-process GPU
  figures unavailable) puts no more models to sleep for room for five minutes: each would
  free nothing the plan could see.
* A failed engine (restart budget spent) moves to another agent with room, or reads Failed
  ``EngineFailed`` with the reason it cannot move in its Scheduled condition.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from contract.reasons import INSUFFICIENT_GPU
from agent_client import AgentUnreachable, Reply
from reconciler.context import Deps
from reconciler.desired import ClaimKey, claim_key
from reconciler.model.manifests import ModelClaim
from reconciler.model.policy import PoolPolicy
from reconciler.observe import AgentObs, EngineObs, Reservation, World
from reconciler.placing import Placer
from reconciler.planning.placement import retry_delay
from reconciler.planning.sleep_policy import idle_to_sleep, victims
from reconciler.planning.state import Candidate, EngineState, Resident
from reconciler.replicas import route_name
from reconciler.routes import WakeRequest
from reconciler.runtime.controller import Result
from reconciler.status import (
    ACTIVATING,
    ENGINE_FAILED,
    ENGINE_SLEEPING,
    ENGINE_STARTING,
    FAILED,
    SLEEPING,
    WAITING_FOR_ROOM,
    ClaimStatus,
)

log = logging.getLogger("reconciler.lifecycle")


WAKE_REFUSALS_BEFORE_REPLAN = 3
RELEASE_RECHECK_S = 0.2  # a model released at the door, busy or starting: look again soon
SLEEP_FAILED_PAUSE_S = 60.0  # a model that refused to sleep for room is not asked again so soon
BLIND_PAUSE_S = 300.0  # an agent that cannot measure sleeping footprints: no sleeps for room


def _shortfall(reply: Reply) -> int:
    """Bytes the agent said it lacks for a wake (needed less free), 0 when it did not say."""
    needed, free = reply.body.get("needed_bytes"), reply.body.get("free_bytes")
    if isinstance(needed, int) and isinstance(free, int):
        return max(0, needed - free)
    return 0


def first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else "no error recorded"


class Lifecycle:
    def __init__(self, deps: Deps) -> None:
        self.w, self.b = deps.reader, deps.books
        self.placer = Placer(deps, self)
        self.waking: set[ClaimKey] = set()  # claims whose wake this reconciler asked for
        # (agent, model) being put to sleep for room: (when asked, when the agent answered)
        self._settling: dict[tuple[str, str], tuple[float, float | None]] = {}
        self._sleep_failed: dict[tuple[str, str], float] = {}  # (agent, model): when
        self._blind: dict[str, float] = {}  # agents that could not measure a sleep: since
        self._failed_seen: dict[ClaimKey, str] = {}
        self._unmeasured: dict[tuple[str, str], float] = {}  # (agent, engine id): since
        self._warned: set[tuple[str, str]] = set()
        # wakes the agent refused for memory, in a row, and the shortfall to plan for
        self._refused: dict[ClaimKey, tuple[int, int]] = {}

    def _pool(self, agent: str) -> tuple[str, PoolPolicy]:
        pool = self.w.pool_of(agent)
        return (pool.name, pool.policy) if pool else ("", PoolPolicy())

    # ---- idle sleep -------------------------------------------------------------------------

    async def idle_check(self, claim: ModelClaim, st: ClaimStatus, world: World, agent: str,
                         cand: Candidate) -> Result:
        pool, policy = self._pool(agent)
        if claim.lifecycle is not None:
            policy = claim.lifecycle.applied_to(policy)
        model, named = claim.model_name, claim.route_name  # named: this replica's
        released = self.b.releases.pending(named, self.w.clock.now())  # asked at the door
        if not (policy.idle_sleep or released) or claim.engine != "vllm" \
                or self.b.wakes.get(named):
            return Result()
        if self.b.metrics:
            self.b.metrics.evaluated(pool)
        resident = cand.residents.get(model)
        if resident is None:
            return Result()
        if released and resident.unmeasured:
            # Its figures are unknown, so a wake could not count its room: it is never slept.
            self.b.releases.failed(named, "it is not measured yet, and is never put to sleep "
                                   "before it is")
            return Result()
        if released and not (resident.can_sleep and resident.state is EngineState.AWAKE):
            return Result(requeue_after=RELEASE_RECHECK_S)  # starting or waking: soon
        if not released and not idle_to_sleep([resident], policy, world.now):
            idle = resident.idle_for(world.now)
            left = policy.sleep_after_seconds - (idle or 0.0)
            return Result(requeue_after=max(0.1, left))
        self.b.holds.hold(named)  # off the route before the last look
        try:
            if not await self.b.routes_out(named):
                log.warning("claim %s: could not take %s off the route; not sleeping it",
                            claim.key, model)
                return Result(requeue_after=retry_delay(0))
            fresh = await self._last_look(agent, model)
            if fresh is None or not self._idle(fresh, named):
                self.b.tracker.busy(agent, model, self.w.clock.now())
                return Result(requeue_after=RELEASE_RECHECK_S if released
                              else policy.sleep_after_seconds)
            reply = await self._call_sleep(agent, model)
            now = self.w.wall()
            if reply.ok:
                idle = resident.idle_for(world.now) or 0.0
                self.b.releases.drop(named)
                st.event(now, "Sleeping", f"released at the front door; put to sleep on {agent}"
                         if released else f"idle for {idle:.0f} s; put to sleep on {agent}")
                st.set(now, SLEEPING, ready=(False, ENGINE_SLEEPING,
                                             f"asleep on {agent}; a request wakes it"))
                if self.b.metrics:
                    self.b.metrics.acted(pool, "sleep")
                self.b.kick_claims(self.w.waiting_keys())
                return Result()
            log.warning("claim %s: sleep on %s failed: %s", claim.key, agent, reply.message)
            self.b.releases.failed(named, f"the agent did not put it to sleep: {reply.message}")
            return Result(requeue_after=retry_delay(0))
        finally:
            self.b.holds.release(named)

    async def _last_look(self, agent: str, model: str) -> EngineObs | None:
        """The engine as figures read from it now show it (``fresh_snapshot``: a steady
        engine's scrape may be ``--scrape-interval-max`` old, and a request sent straight to
        it shows only there); None when they could not be read, or when a request came and
        went since the figures its idleness was judged by (its success counter moved)."""
        try:
            body = await self.w.client(agent).fresh_snapshot([model])
        except (AgentUnreachable, LookupError) as err:
            log.info("agent %s: no fresh look at %s (%s); not sleeping it", agent, model, err)
            return None
        obs = AgentObs.parse(agent, body, self.w.clock.now())
        entries: list[dict[str, Any]] = list(body.get("models") or ())
        if not any(m.get("model_name") == model and m.get("request_figures_fresh") is True
                   for m in entries):
            return None  # not read now (no answer, or an agent without the fresh look)
        self.b.tracker.observe(obs)  # a snapshot like any other: its figures count
        if self.b.tracker.last_busy(agent, model) == obs.fetched_at:
            return None  # busy since the last look (its success counter moved)
        return obs.engine(model)

    def _idle(self, fresh: EngineObs, named: str) -> bool:
        """The last look before a sleep: active, no request running or waiting in the engine,
        none in flight through the front door to this replica (``named``: its route name).
        No await may come between it and the sleep."""
        return fresh.phase == "active" and fresh.load is not None and fresh.load == 0 \
            and self.w.in_flight(named) == 0

    def _route_name(self, agent: str, model: str) -> str:
        """The route name of the engine of ``model`` on ``agent`` (its replica's)."""
        obs = self.w.cache.last(agent)
        engine = obs.engine(model) if obs is not None else None
        ref = engine.claim_ref if engine is not None else None
        return route_name(model, ref) if ref is not None else model

    async def _call_sleep(self, agent: str, model: str) -> Reply:
        try:
            reply = await self.w.client(agent).sleep(model, 1)
        except (AgentUnreachable, LookupError) as err:
            reply = Reply(503, {"message": str(err)})
        self.w.cache.invalidate(agent)
        self.b.kick_kv(agent)
        return reply

    async def sleep_for_room(self, agent: str, victim: str, for_model: str) -> bool:
        """Put ``victim`` to sleep (off the route first, if still idle) to make room.

        The agent counts as settling from the first step: no other pass makes room there
        until a snapshot taken after the agent answered shows what the victim still holds."""
        entry = (agent, victim)
        asked = self.w.clock.now()
        self._settling[entry] = (asked, None)
        named = self._route_name(agent, victim)
        self.b.holds.hold(named)
        try:
            fresh = await self._last_look(agent, victim) \
                if await self.b.routes_out(named) else None
            if fresh is None or not self._idle(fresh, named):
                del self._settling[entry]
                return False
            reply = await self._call_sleep(agent, victim)
            # kept when the call failed too: a timed-out sleep may still have happened
            self._settling[entry] = (asked, self.w.clock.now())
            key = fresh.claim_ref
            vst = self.w.store.get(key) if key is not None else None
            if not reply.ok:
                log.warning("sleeping %s on %s to make room failed: %s", victim, agent,
                            reply.message)
                self._sleep_failed[entry] = self.w.clock.now()
                return False
            now = self.w.wall()
            if vst is not None:
                vst.event(now, "SleptToMakeRoom", f"put to sleep on {agent} to make room for "
                          f"{for_model}")
                vst.set(now, SLEEPING, ready=(False, ENGINE_SLEEPING,
                                              f"asleep on {agent}; a request wakes it"))
            pool, _ = self._pool(agent)
            if self.b.metrics:
                self.b.metrics.acted(pool, "sleep_to_make_room")
            return True
        finally:
            self.b.holds.release(named)

    def sleepable(self, world: World, cand: Candidate) -> Candidate:
        """``cand`` with the models that lately refused to sleep for room marked unable to
        (the plan then picks others, or moves the claim, instead of asking them again), and
        all of them on an agent found unable to measure a sleep."""
        self.settling(world, cand.name)  # brings the agent's sleeps for room up to date
        now = self.w.clock.now()
        for key, at in list(self._sleep_failed.items()):
            if now - at >= SLEEP_FAILED_PAUSE_S:
                del self._sleep_failed[key]
        blind_since = self._blind.get(cand.name)
        if blind_since is not None and now - blind_since >= BLIND_PAUSE_S:
            del self._blind[cand.name]
            blind_since = None
        bad = {model for agent, model in self._sleep_failed if agent == cand.name}
        if blind_since is not None:  # sleeping others there frees nothing we could see
            bad = {e.name for g in cand.gpus for e in g.engines}
        if not bad:
            return cand
        return replace(cand, gpus=tuple(
            replace(g, engines=tuple(replace(e, can_sleep=False) if e.name in bad else e
                                     for e in g.engines)) for g in cand.gpus))

    def settling(self, world: World, agent: str) -> bool:
        """A model is being put to sleep for room on ``agent``, or slept and its sleeping
        footprint is not measured yet. Only a snapshot fetched after the agent answered the
        sleep can end it (an older one may predate the sleep, or its measurement)."""
        obs = world.agents.get(agent)
        for entry, (_, answered) in list(self._settling.items()):
            where, model = entry
            if where != agent or answered is None:
                continue  # another agent, or the sleep call is still in flight
            if world.now - answered > self.w.timings.settle_timeout:
                del self._settling[entry]
                engine = obs.engine(model) if obs is not None and obs.ok else None
                if engine is not None and engine.phase == "sleeping" \
                        and engine.sleeping_footprint is None:
                    log.warning("%s has not measured what %s holds asleep after %g s; no more "
                                "models are put to sleep for room there for %g s", agent,
                                model, self.w.timings.settle_timeout, BLIND_PAUSE_S)
                    self._blind[agent] = world.now
                continue
            if obs is None or not obs.ok or obs.fetched_at <= answered:
                continue
            engine = obs.engine(model)
            if engine is None or (engine.operation is None and (
                    engine.phase != "sleeping" or engine.sleeping_footprint is not None)):
                del self._settling[entry]
        return any(where == agent for where, _ in self._settling)

    # ---- wake -------------------------------------------------------------------------------

    async def sleeping(self, claim: ModelClaim, st: ClaimStatus, world: World, agent: str,
                       engine: EngineObs) -> Result:
        req = self.b.wakes.get(claim.route_name)
        now = self.w.wall()
        if req is None or self.b.wakes.expired(req, world.now):
            self._refused.pop(claim_key(claim), None)
        if req is None:
            st.set(now, SLEEPING, ready=(False, ENGINE_SLEEPING,
                                         f"asleep on {agent}; a request wakes it"))
            return Result(requeue_after=self._footprint_check(st, world, agent, engine))
        if self.b.wakes.expired(req, world.now):
            self.b.wakes.drop(claim.route_name)
            self.b.reservations.drop(agent, claim.model_name)
            st.set(now, SLEEPING, ready=(False, ENGINE_SLEEPING, "the wake request expired "
                                         "without room to wake; the next request asks again"))
            return Result()
        return await self._wake(claim, st, world, agent, engine, req)

    def _footprint_check(self, st: ClaimStatus, world: World, agent: str,
                         engine: EngineObs) -> float | None:
        """With noWakeReserveWhileAsleep, a sleeping engine whose footprint the agent has not
        measured (after ``settle_timeout``) keeps its whole room: a SleepingFootprintUnknown
        event, once per engine. The answer: when to look again, if still waiting."""
        cand, key = world.candidates.get(agent), (agent, engine.engine_id)
        if cand is None or not cand.policy.no_wake_reserve_while_asleep \
                or engine.sleeping_footprint is not None:
            self._unmeasured.pop(key, None)
            return None
        since = self._unmeasured.setdefault(key, world.now)
        left = self.w.timings.settle_timeout - (world.now - since)
        if left > 0:
            return left
        if key not in self._warned:
            self._warned.add(key)
            st.event(self.w.wall(), "SleepingFootprintUnknown", f"{agent} has not measured what "
                     "the sleeping engine holds; it keeps its whole room", warning=True)
        return None

    def _victims(self, world: World, cand: Candidate, engine: EngineObs,
                 room: int, first: tuple[str, ...] = ()) -> list[str] | None:
        """Whom to sleep for ``engine``'s wake, in order; ``first``: the door's choice
        (``WakeRequest.victims``), taken first where they may be slept."""
        cand = self.sleepable(world, cand)
        gpus = [g for g in cand.gpus if g.index in engine.devices] or list(cand.gpus)
        chosen: list[str] = []
        for gpu in gpus:
            picked = victims(gpu.usable, room, gpu.engines, cand.policy, world.now,
                             waking=engine.model_name, other=gpu.other, first=first)
            if picked is None:
                return None
            chosen.extend(v for v in picked if v not in chosen)
        return chosen

    async def _wake(self, claim: ModelClaim, st: ClaimStatus, world: World, agent: str,
                    engine: EngineObs, req: WakeRequest) -> Result:
        model, cand = claim.model_name, world.candidates.get(agent)
        per_gpu = self.w.per_gpu(claim_key(claim))
        if cand is None or per_gpu is None or not cand.healthy:
            return Result(requeue_after=1.0)
        key = claim_key(claim)
        shortfall = self._refused.get(key, (0, 0))[1]
        plan = self._victims(world, cand, engine, per_gpu.room + shortfall, req.victims)
        why = f"no room on {agent} to wake"
        if plan == []:
            reply = await self._call_wake(claim, st, agent, engine, per_gpu.room, world.now)
            if reply.ok:
                self._refused.pop(key, None)
                return Result(requeue_after=self.w.timings.settle_poll)
            if reply.status == 503 and reply.reason is None:
                # No answer (a timeout, a reset): the agent may be waking it all the same. The
                # request stays; the next look sees the engine as it is.
                return Result(requeue_after=1.0)
            if reply.reason != INSUFFICIENT_GPU:
                self._refused.pop(key, None)
                self.b.wakes.drop(claim.route_name)
                now = self.w.wall()
                st.event(now, "WakeFailed", f"on {agent}: {reply.message}", warning=True)
                st.set(now, SLEEPING, ready=(False, ENGINE_SLEEPING,
                                             f"the wake failed on {agent}: {reply.message}"))
                return Result()
            # The agent measures what the engine needs awake and what the card holds; the plan
            # used the claim's figures and a snapshot. Look again a few times (a measurement
            # may be catching up), then plan for the agent's shortfall too.
            refusals = self._refused.get(key, (0, 0))[0] + 1
            short = _shortfall(reply)
            self._refused[key] = (refusals, short if refusals >= WAKE_REFUSALS_BEFORE_REPLAN
                                  else 0)
            why = f"{agent} has no room to wake it: {reply.message}"
            if refusals < WAKE_REFUSALS_BEFORE_REPLAN or (
                    short > 0 and cand.policy.no_wake_reserve_while_asleep
                    and refusals < 3 * WAKE_REFUSALS_BEFORE_REPLAN):
                st.set(self.w.wall(), SLEEPING, ready=(False, WAITING_FOR_ROOM, (
                    f"{why}; asking again")))
                return Result(requeue_after=self.w.timings.settle_poll)
            plan = None
        if plan and cand.policy.no_wake_reserve_while_asleep:
            if not self.settling(world, agent):
                # The room being made is the waking model's: nothing placed or grown takes it.
                self._hold_room(claim, agent, engine, world.now)
                await self.sleep_for_room(agent, plan[0], model)
            st.set(self.w.wall(), SLEEPING, ready=(False, WAITING_FOR_ROOM, (
                f"putting {', '.join(plan)} to sleep on {agent} to make room")))
            return Result(requeue_after=self.w.timings.settle_poll)
        moved = await self.placer.move(claim, st, world, agent, f"could not wake on {agent}: "
                                       f"{why}")
        if isinstance(moved, Result):
            return moved
        left = self.b.wakes.ttl - (world.now - req.at)
        st.set(self.w.wall(), SLEEPING, ready=(False, WAITING_FOR_ROOM, (
            f"{why}, no idle model to put to sleep, and no other agent has room "
            f"({moved.message}); waiting {left:.0f} s more")))
        return Result(requeue_after=max(0.1, min(5.0, left)))

    def _hold_room(self, claim: ModelClaim, agent: str, engine: EngineObs, now: float) -> None:
        """Reserve the claim's whole room where it wakes: placement and the KV division count
        it from now on (while others sleep to make it, and while it wakes)."""
        per_gpu = self.w.per_gpu(claim_key(claim))
        assert per_gpu is not None
        resident = Resident(claim.model_name, per_gpu.maximum_footprint, per_gpu.kv_floor,
                            EngineState.STARTING, last_busy=now)
        self.b.reservations.add(Reservation(agent, claim.model_name, resident, engine.devices,
                                            "wake", now))

    async def _call_wake(self, claim: ModelClaim, st: ClaimStatus, agent: str,
                         engine: EngineObs, room: int, now: float) -> Reply:
        model = claim.model_name
        self._hold_room(claim, agent, engine, now)
        self.waking.add(claim_key(claim))
        wall = self.w.wall()
        st.event(wall, "Waking", f"waking on {agent}")
        st.set(wall, ACTIVATING, ready=(False, ENGINE_STARTING, f"waking on {agent}"))
        try:
            reply = await self.w.client(agent).wake(model)
        except (AgentUnreachable, LookupError) as err:
            reply = Reply(503, {"message": str(err)})
        self.w.cache.invalidate(agent)
        self.b.kick_kv(agent)
        if reply.ok:
            self.b.tracker.busy(agent, model, self.w.clock.now())
            pool, _ = self._pool(agent)
            if self.b.metrics:
                self.b.metrics.acted(pool, "wake")
        else:
            self.b.reservations.drop(agent, model)
            self.waking.discard(claim_key(claim))
            st.set(self.w.wall(), SLEEPING, ready=(False, ENGINE_SLEEPING, reply.message))
        return reply

    def woke(self, key: ClaimKey, model: str, st: ClaimStatus, agent: str) -> bool:
        """The claim serves (again): a ``Woken`` event if it was asleep or woken, and its wake
        request removed (``model``: its route name). True when it was a wake."""
        req = self.b.wakes.get(model)
        woken = key in self.waking or st.phase == SLEEPING
        if woken:
            waited = f" {self.w.clock.now() - req.at:.1f} s after the request" if req else ""
            st.event(self.w.wall(), "Woken", f"serves on {agent} again{waited}")
        self.waking.discard(key)
        self._refused.pop(key, None)
        self.b.wakes.drop(model)
        return woken

    # ---- failure ----------------------------------------------------------------------------

    async def failed(self, claim: ModelClaim, st: ClaimStatus, world: World, agent: str,
                     engine: EngineObs) -> Result:
        error = first_line(engine.last_error)
        now = self.w.wall()
        if self._failed_seen.get(claim_key(claim)) != engine.engine_id:
            self._failed_seen[claim_key(claim)] = engine.engine_id
            st.event(now, ENGINE_FAILED, f"the engine failed permanently on {agent} after "
                     f"{engine.restart_count} restarts: {error}", warning=True)
        moved = await self.placer.move(claim, st, world, agent, "its engine failed permanently")
        if isinstance(moved, Result):
            return moved
        attempts = st.attempts
        st.set_attempts(attempts + 1)
        st.set(now, FAILED, scheduled=(False, moved.reason, f"cannot move: {moved.message}"),
               ready=(False, ENGINE_FAILED, f"the engine failed permanently on {agent}: "
                      f"{error}"))
        return Result(requeue_after=retry_delay(attempts))
