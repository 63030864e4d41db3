"""The ClaimReconciler: one claim's desired state against its engine, one key at a time.

``reconcile((namespace, name))`` is level-based: it reads the manifest, the claim's status and
every agent's snapshot (through the cache), and makes one step towards the desired state:

* the manifest is gone -> ``Drain`` (off the route, requests finish, engine stopped);
* the claim is held back (``InvalidEngineConfig``: Failed; ``InvalidPerGPU``: Pending) and has
  no engine -> status with the reason, nothing else (a change of the claim brings it back);
* no engine answers to it -> ``Placer`` (place, make room, or Pending with the reason). An
  engine that vanished from a reachable agent, or whose agent stayed silent past the grace
  period, is placed again (``NotPlaced`` until then, a ``Rescheduled`` event);
* an engine answers to it -> follow its phase: starting or restarting -> Activating
  ``EngineStarting``; active -> Active once its KV limit holds (then the sleep policy);
  sleeping -> Sleeping, or the wake path when a wake is requested; failed -> move or Failed.

The engine is found by its ``claim_ref`` in the snapshots, not by what the status remembers, so
a restarted reconciler, or an agent that re-adopted its engines, needs no repair. An engine of
the claim on a second agent (the claim was placed again while its first agent was silent, and
that agent came back) is stopped.

A claim with ``replicas: N`` (``reconciler.replicas``) has replicas 1..N-1 reconciled under
keys of their own, each as a claim: a reconcile of the claim looks at them too.
"""

from __future__ import annotations

import logging

from agent_client import AgentUnreachable
from reconciler.context import Deps
from reconciler.desired import ClaimKey, claim_key
from reconciler.drain import Drain
from reconciler.footprints import Measured, measured_footprint
from reconciler.lifecycle import Lifecycle, first_line
from reconciler.model.manifests import ModelClaim
from reconciler.moving import Mover
from reconciler.observe import EngineObs, World
from reconciler.planning.placement import gpus_text
from reconciler.replicas import is_replica, replica_keys, surplus
from reconciler.runtime.controller import Result
from reconciler.scaler import Scaler
from reconciler.status import (
    ACTIVATING,
    ACTIVE,
    ENGINE_STARTING,
    FAILED,
    INVALID_ENGINE_CONFIG,
    INVALID_PER_GPU,
    MODEL_CLAIM_ACTIVE,
    NOT_PLACED,
    PENDING,
    PLACED,
    ClaimStatus,
)

log = logging.getLogger("reconciler.claims")
MEASURED_RECHECK_S = 0.05  # a claim whose figures were just measured is looked at again
# An engine placed to be measured waits this long, ready, for its agent's first GPU sample
# before it goes on the route unmeasured (an agent that reports no per-process HBM).
MEASURE_WAIT_S = 30.0


class ClaimReconciler:
    """Reconciles ModelClaims by key; give it to a ``Controller``."""

    def __init__(self, deps: Deps) -> None:
        self.w, self.b = deps.reader, deps.books
        self.life = Lifecycle(deps)
        self.placer = self.life.placer
        self.drain = Drain(deps)
        self.scaler = Scaler(deps, self.placer.could_place)  # copies by demand
        self.mover = Mover(deps, self.placer)  # make before break, off a draining agent
        # (claim, engine id) -> when its ready engine began to wait for its measurement
        self._measuring: dict[tuple[ClaimKey, str], float] = {}

    async def reconcile(self, key: ClaimKey) -> Result:
        if not is_replica(key):
            self.scaler.adopt(key)  # the count a previous run chose, before its replicas
        result = await self._reconcile(key)
        return result if is_replica(key) else await self.scaler.look(key, result)

    async def _reconcile(self, key: ClaimKey) -> Result:
        claim = self.w.desired.claim(key)
        if not is_replica(key):
            self._replicas(key, claim)
        if claim is None:
            return await self.drain.reconcile(key)
        self.drain.forget(key)  # created again while its engine drained: it takes it over
        st = self.w.store.ensure(claim)
        self.w.rooms.claim_changed(key)
        problem = self.w.desired.spec_problem(key)
        st.set_spec_problem(self.w.wall(), problem.reason if problem else None,
                            problem.message if problem else "")
        st.set_lifecycle(self.w.wall(), claim.lifecycle is not None
                         or claim.lifecycle_problem is not None, claim.lifecycle_problem)
        world = await self.w.world(focus=(st.instance.agent,) if st.instance else ())
        home = await self._home(claim, st, world)
        if home is not None and not world.agents[home[0]].ok:
            st.set_instance(home[0], home[1].port, home[1].devices)
            home = None  # its agent is silent: wait for it, or give the engine up
        hold = claim.hold_reason
        if home is None and hold is not None:
            return self._held(claim, st, hold)
        if home is None:
            lost = self._lost(st, world)
            if lost is not None:
                return lost
            return await self.placer.place(claim, st, world)
        agent, engine = home
        switched, again = await self.mover.step(claim, st, world, agent, engine)
        if switched:  # the new engine serves now: the next look follows it
            return Result(requeue_after=again)
        result = await self._follow(claim, st, world, agent, engine)
        if again is None:
            return result
        known = result.requeue_after
        return Result(requeue_after=again if known is None else min(known, again))

    def _replicas(self, key: ClaimKey, claim: ModelClaim | None) -> None:
        """A claim's replicas 1.. are looked at with it (``reconciler.replicas``): those it
        asks for, and those it no longer asks for (they drain)."""
        replicas = claim.replicas if claim is not None else 0
        for replica in [*replica_keys(key, replicas),
                        *surplus(key, replicas, self.w.store.replica_keys(key))]:
            self.b.kick_claim(replica)

    def _measured(self, claim: ModelClaim, agent: str, engine: EngineObs) -> bool:
        """A claim placed on estimated figures, or placed to be measured, whose engine now runs:
        its measured footprint recorded (``reconciler.footprints``); True when that changed the
        claim's figures."""
        if not claim.figures_found:
            return False
        footprint = measured_footprint(engine.hbm_peak, engine.kv_used,
                                       len(engine.devices) or claim.gpus_needed)
        if footprint is None:
            return False
        seen = Measured(footprint, agent, self.w.wall(), engine.hbm_peak or 0,
                        engine.kv_used or 0)
        if not self.w.desired.measured(claim.artifact_url, claim.engine_args, seen):
            return False
        was = claim.per_gpu.estimated.split(":")[0] if claim.per_gpu else "unmeasured"
        log.info("claim %s: measured at %d MiB per GPU on %s (was %s)", claim.key,
                 footprint >> 20, agent, was)
        return True

    def _unmeasured(self, claim: ModelClaim, st: ClaimStatus, agent: str, engine: EngineObs,
                    sched: tuple[bool, str, str]) -> Result | None:
        """A ready engine placed to be measured stays off the route until it is: measured, its
        figures give it a KV limit first, as any claim's. An agent that has no GPU sample of it
        within ``MEASURE_WAIT_S`` lets it go on unmeasured (None: go on)."""
        now, key = self.w.wall(), (claim_key(claim), engine.engine_id)
        if self._measured(claim, agent, engine):
            self._measuring.pop(key, None)
            st.set(now, ACTIVATING, scheduled=sched, ready=(False, ENGINE_STARTING, (
                f"the engine was measured on {agent} and waits for its KV limit")))
            self.b.kick_kv(agent)
            return Result(requeue_after=MEASURED_RECHECK_S)
        since = self._measuring.setdefault(key, self.w.clock.now())
        if self.w.clock.now() - since >= MEASURE_WAIT_S:
            del self._measuring[key]  # it goes Active now, and an Active one waits no more
            return None
        st.set(now, ACTIVATING, scheduled=sched, ready=(False, ENGINE_STARTING, (
            f"the engine is ready on {agent} and waits to be measured")))
        return Result(requeue_after=self.w.timings.kv_gate_poll)

    def _held(self, claim: ModelClaim, st: ClaimStatus, hold: str) -> Result:
        message = next((p.message for p in claim.problems if p.reason == hold), hold)
        now = self.w.wall()
        st.set_instance(None)
        if hold == INVALID_ENGINE_CONFIG:
            st.set(now, FAILED, ready=(False, INVALID_ENGINE_CONFIG, message))
        else:
            st.set(now, PENDING, scheduled=(False, INVALID_PER_GPU, message),
                   ready=(False, NOT_PLACED, "the claim waits to be placed"))
        return Result()

    async def _home(self, claim: ModelClaim, st: ClaimStatus,
                    world: World) -> tuple[str, EngineObs] | None:
        """The claim's engine; any other engine answering to the claim is stopped."""
        found = world.engines_of((claim.namespace, claim.name))
        mine = [(a, e) for a, e in found if e.model_name == claim.model_name]
        inst = st.instance
        home = next(((a, e) for a, e in mine if inst is not None and a == inst.agent), None)
        if home is None and mine:
            home = next(((a, e) for a, e in mine if e.phase == "active"), mine[0])
        for agent, engine in found:
            if (agent, engine) == home or not world.agents[agent].ok \
                    or self.mover.keeps(claim, st, world, agent, engine):
                continue
            if self.mover.draining(world, agent):
                log.info("claim %s: the engine on %s finished its requests after the move; "
                         "stopping it", claim.key, agent)
            else:
                log.warning("claim %s: stopping a second engine %s on %s", claim.key,
                            engine.model_name, agent)
            try:
                await self.w.client(agent).deactivate(engine.model_name)
            except (AgentUnreachable, LookupError) as err:
                log.warning("claim %s: could not stop it: %s", claim.key, err)
            self.w.cache.invalidate(agent)
            self.b.kick_kv(agent)
        return home

    def _lost(self, st: ClaimStatus, world: World) -> Result | None:
        """The claim was placed and its engine is not seen: wait for a silent agent (within
        the grace period), else record the loss and let it be placed again (None)."""
        inst = st.instance
        if inst is None:
            return None
        obs = world.agents.get(inst.agent)
        grace = self.w.timings.unreachable_grace
        silent = obs.silent_since if obs is not None else None
        if obs is not None and silent is not None and world.now - silent < grace:
            left = grace - (world.now - silent)
            st.set(self.w.wall(), st.phase if st.phase != ACTIVE else ACTIVATING,
                   ready=(False, st.reason("Ready") if st.phase != ACTIVE else ENGINE_STARTING,
                          f"{inst.agent} does not answer ({obs.error}); waiting {left:.0f} s "
                          "before placing the claim again"))
            return Result(requeue_after=min(2.0, max(0.1, left)))
        why = "does not answer" if obs is None or not obs.ok else "no longer runs its engine"
        now = self.w.wall()
        st.event(now, "Rescheduled", f"{inst.agent} {why}; placing the claim again")
        st.set_instance(None)
        st.set(now, PENDING, ready=(False, NOT_PLACED, f"the engine on {inst.agent} is gone "
                                    f"({why}); the claim waits to be placed again"))
        return None

    async def _follow(self, claim: ModelClaim, st: ClaimStatus, world: World, agent: str,
                      engine: EngineObs) -> Result:
        now = self.w.wall()
        st.set_instance(agent, engine.port, engine.devices)
        st.set_attempts(0)
        measuring = ", to be measured there" if claim.to_measure else ""
        sched = (True, PLACED, f"placed on {agent} ({gpus_text(engine.devices)}){measuring}")
        phase = engine.phase
        if phase in ("activating", "booting", "stopping"):
            st.set(now, ACTIVATING, scheduled=sched, ready=(False, ENGINE_STARTING,
                                                             f"the engine is {phase} on {agent}"))
            return Result(requeue_after=self.w.timings.starting_poll)
        if phase == "restarting":
            st.set(now, ACTIVATING, scheduled=sched, ready=(False, ENGINE_STARTING, (
                f"the engine is restarting on {agent} (restart {engine.restart_count}): "
                f"{first_line(engine.last_error)}")))
            return Result(requeue_after=self.w.timings.starting_poll)
        if phase == "failed":
            return await self.life.failed(claim, st, world, agent, engine)
        if phase == "sleeping" and engine.operation != "wake":
            st.set_scheduled(now, *sched)
            return await self.life.sleeping(claim, st, world, agent, engine)
        if phase != "active" or engine.operation == "wake":
            st.set(now, ACTIVATING, scheduled=sched,
                   ready=(False, ENGINE_STARTING, f"the engine is waking on {agent}"))
            return Result(requeue_after=self.w.timings.settle_poll)
        if claim.to_measure and st.phase != ACTIVE:
            # (an Active one, found again by a restarted reconciler, is measured below)
            held = self._unmeasured(claim, st, agent, engine, sched)
            if held is not None:
                return held
        if engine.kv_present and claim.per_gpu is not None and (
                engine.kv_applied is None or engine.kv_not_held):
            st.set(now, ACTIVATING, scheduled=sched, ready=(False, ENGINE_STARTING, (
                f"the engine is ready on {agent} and waits for its KV limit")))
            self.b.kick_kv(agent)
            return Result(requeue_after=self.w.timings.kv_gate_poll)
        key = claim_key(claim)
        if st.phase != ACTIVE and not self.life.woke(key, claim.route_name, st, agent):
            st.event(now, "Activated", f"serves on {agent} port {engine.port}")
        st.set(now, ACTIVE, scheduled=sched,
               ready=(True, MODEL_CLAIM_ACTIVE, f"serves on {agent} port {engine.port}"))
        if self._measured(claim, agent, engine):
            return Result(requeue_after=MEASURED_RECHECK_S)  # carry the measured figures
        cand = world.candidates.get(agent)
        if cand is None:
            return Result()
        return await self.life.idle_check(claim, st, world, agent, cand)
