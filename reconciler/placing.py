"""Placing a claim: choose an agent, start the engine there, or say why not.

The choice is the planners' (``place``; ``make_room`` when the pool lets idle models sleep for
room); this module acts on it. A choice and its reservation happen without an await between
them, so two claims reconciled at once never count the same room twice; the reservation stands
until a snapshot shows the engine (or the activation fails).

* Placed: activate on the agent with the claim's perGPU, its claim_ref and a first KV limit of
  its KV floor (the KV divider grows it) -> Activating, ``Scheduled=Placed``. A refusal
  (``InsufficientGPUMemory`` from an agent that measured less room than the snapshot showed,
  an error, no answer) -> Failed ``ActivateFailed``, tried again after 10, 20, 40, then 60 s;
  ``InvalidEngineConfig`` -> Failed, not retried (the claim must be recreated).
* Unplaced -> Pending with the reason, and the closest candidate in the message; tried again
  after ``retry_delay`` (and at once when room may have appeared: ``Books.kick_claims``).
* A replica of a claim (``reconciler.replicas``) is placed apart from the others: agents that
  run or reserved one are left out; when only they have room, Pending
  ``ReplicaNeedsAnotherPod`` says so.
* ``move``: the same, away from an agent (a failed engine, a wake with no room): the engine
  there is stopped first, and the claim reads Failed ``Moving`` until the new one starts.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Protocol

from contract.reasons import INSUFFICIENT_GPU, STOPPED_MEANWHILE
from contract.reasons import INVALID_ENGINE_CONFIG as AGENT_INVALID_CONFIG
from contract.reasons import TOO_LARGE as AGENT_TOO_LARGE
from agent_client import ActivateSpec, AgentUnreachable, Reply
from reconciler.context import Deps
from reconciler.model.manifests import ModelClaim
from reconciler.observe import Reservation, World
from reconciler.planning.placement import (
    RETRY_EVERY,
    ClaimNeed,
    Placed,
    Unplaced,
    gpus_text,
    place,
    prestage_targets,
    retry_delay,
)
from reconciler.planning.sleep_policy import MakeRoom, make_room
from reconciler.planning.state import Candidate, EngineState, Resident
from reconciler.replicas import REPLICA_NEEDS_ANOTHER_POD
from reconciler.runtime.controller import Result
from reconciler.status import (
    ACTIVATE_FAILED,
    ACTIVATING,
    ENGINE_STARTING,
    FAILED,
    INVALID_ENGINE_CONFIG,
    INVALID_PER_GPU,
    MAKING_ROOM,
    MOVING,
    NO_MATCHING_PODS,
    NOT_PLACED,
    PENDING,
    PLACED,
    TOO_LARGE,
    ClaimStatus,
)

log = logging.getLogger("reconciler.placing")
RACED_RETRY_S = 1.0  # an activation a concurrent deactivate stopped: placed again this soon
PRE_STAGING = "PreStaging"
REFRESH_TRIES = 8  # agents read again for one placement before every agent is read
INF = float("inf")


class Placer:
    def __init__(self, deps: Deps, sleep_for_room: SleepForRoom) -> None:
        self.w, self.b = deps.reader, deps.books
        self._sleep_for_room = sleep_for_room

    async def place(self, claim: ModelClaim, st: ClaimStatus, world: World) -> Result:
        """Place an unplaced claim, make room for it, or record why it waits. The room index
        answers when an agent can take the claim; otherwise every agent is read again (none
        older than ``others_max_age``) to say why it waits or to make room."""
        need = ClaimNeed.from_claim(claim, apart=self.apart(claim, world))
        quick = await self._indexed(need, world)
        if quick is not None:
            self._reserve(claim, quick, self.w.clock.now())
            return await self.activate(claim, st, quick)
        if self.w.timings.others_max_age is not None:
            world = await self.w.world(placing=True)
        candidates = world.candidate_list()
        got = place(need, candidates, world.now,
                    max_snapshot_age=self.w.timings.max_snapshot_age)
        if isinstance(got, Placed):
            self._reserve(claim, got, world.now)
            return await self.activate(claim, st, got)
        if got.reason == NO_MATCHING_PODS:
            room = make_room(need, [self._sleep_for_room.sleepable(world, c)
                                    for c in candidates],
                             world.now, max_snapshot_age=self.w.timings.max_snapshot_age)
            if room is not None:
                return await self._make_room(claim, st, room, world)
        await self._pre_stage(claim, st, need, candidates, world)
        if need.apart:
            stacked = place(replace(need, apart=frozenset()), candidates, world.now,
                            max_snapshot_age=self.w.timings.max_snapshot_age)
            if isinstance(stacked, Placed):  # say so, rather than stack replicas on one Pod
                got = Unplaced(REPLICA_NEEDS_ANOTHER_POD, (
                    f"only {stacked.agent} has room, and it runs another replica of the claim "
                    f"(replicas of a claim go to different Pods): {got.message}"))
        return self.pending(st, got)

    async def could_place(self, claim: ModelClaim) -> bool:
        """Whether ``claim`` (a replica to add, say) would be placed now on free room, apart
        from the claim's other replicas; nothing is reserved or slept for it."""
        world = await self.w.world(placing=True)
        need = ClaimNeed.from_claim(claim, apart=self.apart(claim, world))
        return isinstance(place(need, world.candidate_list(), world.now,
                                max_snapshot_age=self.w.timings.max_snapshot_age), Placed)

    def apart(self, claim: ModelClaim, world: World) -> frozenset[str]:
        """Agents that run, or have reserved, another replica of the claim (none for a claim
        of one replica): ``reconciler.replicas``."""
        if claim.replicas <= 1:
            return frozenset()
        key = (claim.namespace, claim.name)
        out = {name for name, obs in world.agents.items()
               if (e := obs.engine(claim.model_name)) is not None and e.claim_ref != key}
        return frozenset(out | self.b.reservations.agents_for(claim.model_name))

    async def _indexed(self, need: ClaimNeed, world: World) -> Placed | None:
        """The room index's choice over ``world``'s snapshots, or None when no agent there can
        take the claim. With ``others_max_age`` set, the snapshots serve at any age unless
        something made them stale (an event, a call of ours); the chosen agent's is read
        again when older, and the choice made again on it, so no more than a few agents are
        read, not the fleet. Nothing is awaited between the last choice and the return."""
        observed = dict(world.agents)
        limit = self.w.timings.others_max_age
        max_age = self.w.timings.max_snapshot_age
        judged_at = max_age if limit is None else INF  # the index's own age check
        age = INF if limit is None else min(limit, max_age)  # the chosen agent's, here
        for _ in range(REFRESH_TRIES):
            index = self.w.rooms.sync(observed)
            now = self.w.clock.now()
            got = index.best(need, now, max_snapshot_age=judged_at)
            if got is None:
                return None
            if now - observed[got.agent].fetched_at <= age:
                return got
            observed[got.agent] = await self.w.cache.get(got.agent, age)
        return None

    async def _pre_stage(self, claim: ModelClaim, st: ClaimStatus, need: ClaimNeed,
                         candidates: list[Candidate], world: World) -> None:
        """A claim that waits to be placed has its artifact staged on the agents that may take
        it, when their pool's policy asks (``artifacts.preStage``): the start reads local disk."""
        if claim.engine == "ollama":
            return  # Ollama pulls its own models
        for agent in prestage_targets(need, candidates, world.now,
                                      self.w.timings.max_snapshot_age):
            try:
                reply = await self.w.client(agent).download(claim.artifact_url)
            except (AgentUnreachable, LookupError) as err:
                log.info("pre-staging %s on %s: %s", claim.artifact_url, agent, err)
                continue
            self.w.cache.invalidate(agent)
            if reply.ok:
                st.event(self.w.wall(), PRE_STAGING, f"{agent} stages {claim.artifact_url} "
                         "while the claim waits to be placed")
            else:
                log.info("pre-staging %s on %s refused: %s", claim.artifact_url, agent,
                         reply.message)

    def pending(self, st: ClaimStatus, got: Unplaced) -> Result:
        now = self.w.wall()
        st.set_instance(None)
        st.set(now, PENDING, scheduled=(False, got.reason, got.message),
               ready=(False, NOT_PLACED, "the claim waits to be placed"))
        if got.reason == INVALID_PER_GPU:
            return Result()  # only a change of the claim helps, and that enqueues it
        if got.reason == TOO_LARGE:
            return Result(requeue_after=RETRY_EVERY)  # an agent may still show a larger card
        attempts = st.attempts
        st.set_attempts(attempts + 1)
        return Result(requeue_after=retry_delay(attempts))

    async def _make_room(self, claim: ModelClaim, st: ClaimStatus, room: MakeRoom,
                         world: World) -> Result:
        """Sleep the first victim; the next look plans again, once what it still holds is
        measured (until then a sleeping engine counts with its whole room)."""
        message = (f"putting {', '.join(room.victims)} to sleep on {room.agent} "
                   f"({gpus_text(room.devices)}) to make room")
        st.set(self.w.wall(), PENDING, scheduled=(False, MAKING_ROOM, message),
               ready=(False, NOT_PLACED, "the claim waits to be placed"))
        if not self._sleep_for_room.settling(world, room.agent):
            await self._sleep_for_room.sleep_for_room(room.agent, room.victims[0],
                                                      claim.model_name)
        return Result(requeue_after=self.w.timings.settle_poll)

    def _reserve(self, claim: ModelClaim, got: Placed, now: float) -> None:
        """Hold the claim's room on the chosen GPUs until a snapshot shows its engine: its
        perGPU, or for a claim placed to be measured the GPUs whole."""
        per_gpu = claim.per_gpu
        if per_gpu is None:
            resident = Resident(claim.model_name, 0, 0, EngineState.STARTING, last_busy=now,
                                unmeasured=True)
        else:
            resident = Resident(claim.model_name, per_gpu.maximum_footprint, per_gpu.kv_floor,
                                EngineState.STARTING, last_busy=now)
        self.b.reservations.add(Reservation(got.agent, claim.model_name, resident, got.devices,
                                            "activate", now))

    @staticmethod
    def _spec(claim: ModelClaim, st: ClaimStatus) -> ActivateSpec:
        per_gpu = claim.per_gpu
        return ActivateSpec(claim.model_name, claim.artifact_url, claim.engine,
                            dict(claim.engine_args), claim.namespace, claim.name, st.uid,
                            per_gpu.maximum_footprint if per_gpu else None,
                            per_gpu.kv_floor if per_gpu else None,
                            kv_limit_bytes=per_gpu.kv_floor if per_gpu else None)

    async def start_elsewhere(self, claim: ModelClaim, st: ClaimStatus,
                              away_from: str) -> tuple[Placed, int] | str:
        """Start a second engine of the claim on another agent's free room, the claim's own
        engine and status left as they are (a make-before-break move, ``reconciler.moving``):
        where it went and its port, or why it could not."""
        world = await self.w.world(placing=True, focus=(away_from,))
        need = ClaimNeed.from_claim(claim, frozenset({away_from}), self.apart(claim, world))
        got = place(need, world.candidate_list(), world.now,
                    max_snapshot_age=self.w.timings.max_snapshot_age)
        if not isinstance(got, Placed):
            return got.message
        self._reserve(claim, got, world.now)
        try:
            reply = await self.w.client(got.agent).activate(self._spec(claim, st))
        except (AgentUnreachable, LookupError) as err:
            reply = Reply(503, {"message": str(err)})
        self.w.cache.invalidate(got.agent)
        if not reply.ok:
            self.b.reservations.drop(got.agent, claim.model_name)
            return f"{got.agent} refused the start: {reply.message}"
        self.b.kick_kv(got.agent)
        port = reply.body.get("port")
        return got, port if isinstance(port, int) else 0

    async def activate(self, claim: ModelClaim, st: ClaimStatus, got: Placed) -> Result:
        """Start the claim's engine on the chosen (and reserved) agent: with its perGPU and a
        first KV limit of its floor, or, placed to be measured, with neither (the agent then
        gives the start its GPUs alone and measures it)."""
        agent, metrics = got.agent, self.b.metrics
        per_gpu = claim.per_gpu
        spec = self._spec(claim, st)
        st.set_instance(agent, 0, got.devices)
        reply: Reply | None = None
        try:
            reply = await self.w.client(agent).activate(spec)
            error = reply.message
        except (AgentUnreachable, LookupError) as err:
            error = str(err)
        self.w.cache.invalidate(agent)
        now = self.w.wall()
        if reply is not None and reply.ok:
            port = reply.body.get("port")
            st.set_instance(agent, port if isinstance(port, int) else 0, got.devices)
            st.set_attempts(0)
            measured = "" if per_gpu else ", to be measured there"
            st.set(now, ACTIVATING,
                   scheduled=(True, PLACED, f"placed on {agent} ({gpus_text(got.devices)})"
                              f"{measured}"),
                   ready=(False, ENGINE_STARTING, f"the engine is starting on {agent}"))
            if metrics:
                metrics.activation("success")
            self.b.kick_kv(agent)
            return Result(requeue_after=self.w.timings.starting_poll)
        self.b.reservations.drop(agent, claim.model_name)
        st.set_instance(None)
        if reply is not None and reply.reason == AGENT_INVALID_CONFIG:
            if metrics:
                metrics.activation("invalid")
            st.event(now, INVALID_ENGINE_CONFIG, f"{agent}: {error}", warning=True)
            st.set(now, FAILED, ready=(False, INVALID_ENGINE_CONFIG, error))
            return Result()
        if reply is not None and reply.reason == STOPPED_MEANWHILE:
            # a hand-run deactivate raced this start: nothing failed; place it again soon
            st.event(now, "Rescheduled", f"{agent}: {error}")
            st.set(now, PENDING, scheduled=(False, NO_MATCHING_PODS, f"{agent}: {error}"),
                   ready=(False, NOT_PLACED, "the claim waits to be placed again"))
            return Result(requeue_after=RACED_RETRY_S)
        refused = reply is not None and reply.reason in (INSUFFICIENT_GPU, AGENT_TOO_LARGE)
        if metrics:
            metrics.activation("refused" if refused else "failed")
        attempts = st.attempts
        st.set_attempts(attempts + 1)
        st.event(now, ACTIVATE_FAILED, f"{agent}: {error}", warning=True)
        st.set(now, FAILED, scheduled=(False, NO_MATCHING_PODS, f"{agent} did not start the "
                                       f"engine: {error}"),
               ready=(False, ACTIVATE_FAILED, f"{agent}: {error}"))
        return Result(requeue_after=retry_delay(attempts))

    async def move(self, claim: ModelClaim, st: ClaimStatus, world: World, away_from: str,
                   why: str) -> Result | Unplaced:
        """Stop the engine on ``away_from`` and start the claim elsewhere, if another agent has
        room; otherwise the ``Unplaced`` that says why it cannot move."""
        world = await self.w.world(placing=True, focus=(away_from,))
        need = ClaimNeed.from_claim(claim, frozenset({away_from}), self.apart(claim, world))
        got = place(need, world.candidate_list(), world.now,
                    max_snapshot_age=self.w.timings.max_snapshot_age)
        if not isinstance(got, Placed):
            return got
        self._reserve(claim, got, world.now)
        now = self.w.wall()
        message = f"moving from {away_from} to {got.agent}: {why}"
        st.event(now, "Rescheduled", message)
        st.set(now, FAILED, ready=(False, MOVING, message))
        pool = self.w.pool_of(away_from)
        if self.b.metrics and pool is not None:
            self.b.metrics.acted(pool.name, "move")
        try:
            reply = await self.w.client(away_from).deactivate(claim.model_name)
        except (AgentUnreachable, LookupError) as err:
            reply = Reply(503, {"message": str(err)})
        self.w.cache.invalidate(away_from)
        if not reply.ok:
            self.b.reservations.drop(got.agent, claim.model_name)
            raise RuntimeError(f"stopping {claim.model_name} on {away_from} failed: "
                               f"{reply.message}")
        self.b.kick_kv(away_from)
        return await self.activate(claim, st, got)


class SleepForRoom(Protocol):
    """What the placer needs from the lifecycle: put one model to sleep to make room."""

    async def sleep_for_room(self, agent: str, victim: str, for_model: str) -> bool: ...

    def settling(self, world: World, agent: str) -> bool: ...

    def sleepable(self, world: World, cand: Candidate) -> Candidate: ...
