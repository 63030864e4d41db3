"""Copies by demand, carried out (issue 25, item 2): a claim with ``spec.maxReplicas`` above
its ``spec.replicas`` runs as many engines as its queue asks for, within that range.

Each look at such a claim (its reconcile, at least once a second while it has a range) reads
what ``planning.scaling.next_count`` weighs, and sets the count it answers in the desired state
(``Desired.scale``): the claim's ``replicas`` is then that count everywhere it is read (the
door spreads calls over the replicas that serve, the reconciler places, drains, sleeps and
wakes each replica as for ``replicas: N``; ``aibrix_modelclaim_desired_replicas`` reports it).

* the queue: the door's (``WorldReader.queue_wait``): when a new call could start on one of
  the claim's serving replicas, from the door's own forwards to them and their latency;
* a copy's load: its footprint at 1 GiB/s (the seed's figure);
* room: a placement of the next replica would succeed now (on an agent that runs none of the
  claim's replicas, on free memory: nothing is slept for a copy);
* each replica: serving (Active), and idle for how long, None while the door has a call in
  flight or held for it: awake, since its requests last ended (the idle tracker, fed by the
  door's forwards and the engine's own running and waiting); asleep, its sleepAfterSeconds
  (it slept for being idle that long) plus how long it has slept (its Ready condition's age);
* the scale-down idle time: twice the replica's sleepAfterSeconds under its claim's and
  pool's policy (``scaling.down_after``).

The count is kept in the claim's status (``desiredReplicas``): a reconciler started again takes
it up before it looks at the claim (``adopt``), so the copies it runs are not drained.

A change is an event on the claim (``ScaledUp``/``ScaledDown``, with the figures) and a look
at its replicas now (a new one is placed; a removed one drains: off the route, requests
finish, engine stopped).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace

from reconciler.context import Deps
from reconciler.desired import ClaimKey
from reconciler.model.manifests import ModelClaim
from reconciler.planning.scaling import (
    Replica,
    down_after,
    next_count,
    queue_costs_more,
)
from reconciler.replicas import replica_key, route_name
from reconciler.runtime.controller import Result
from reconciler.selection.delay import bring_up
from reconciler.status import ACTIVE, READY, SLEEPING, ClaimStatus

LOOK_EVERY_S = 1.0  # a claim with a range is looked at this often


class Scaler:
    """Steps the count of claims with copies by demand; ``room``: whether a copy of the claim
    (the replica claim given) could be placed now."""

    def __init__(self, deps: Deps, room: Callable[[ModelClaim], Awaitable[bool]]) -> None:
        self.w, self.b = deps.reader, deps.books
        self._room = room
        self._over_since: dict[ClaimKey, float] = {}
        self._adopted: set[ClaimKey] = set()

    def adopt(self, key: ClaimKey) -> None:
        """A reconciler started again runs the count its last run chose (the claim's status
        keeps it, ``desiredReplicas``), brought into the range: the copies it added are taken
        over, not drained. Once per claim, before its first reconcile."""
        if key in self._adopted:
            return
        self._adopted.add(key)
        claim = self.w.desired.claim(key)
        st = self.w.store.get(key)
        if claim is not None and claim.replica_range is not None and st is not None \
                and st.desired_replicas != claim.replicas:
            self.w.desired.scale(key, st.desired_replicas)

    async def look(self, key: ClaimKey, result: Result) -> Result:
        """One step for the claim ``key`` (a base claim), and when to look again."""
        claim = self.w.desired.claim(key)
        span = claim.replica_range if claim is not None else None
        if claim is None or span is None:
            self._over_since.pop(key, None)
            return result
        now = self.w.clock.now()
        sleep_after = self._sleep_after(claim)
        replicas = [self._replica(claim, i, now, sleep_after) for i in range(claim.replicas)]
        queue = self.w.queue_wait(key)
        per_gpu = self.w.per_gpu(key)
        load = bring_up(None, per_gpu.maximum_footprint) if per_gpu else float("inf")
        if queue_costs_more(queue, load):
            over = now - self._over_since.setdefault(key, now)
        else:
            self._over_since.pop(key, None)
            over = 0.0
        down = down_after(sleep_after)
        step = next_count(*span, replicas, queue, load, over, True, down)
        if step.count > claim.replicas and not await self._room(self._next_copy(claim)):
            step = next_count(*span, replicas, queue, load, over, False, down)
        if step.count != claim.replicas and self.w.desired.scale(key, step.count):
            self._over_since.pop(key, None)
            st = self.w.store.get(key)
            if st is not None:
                st.event(self.w.wall(), step.reason,
                         f"{claim.replicas} -> {step.count} engines: {step.message}")
            for i in range(max(claim.replicas, step.count)):
                self.b.kick_claim(replica_key(key, i))
        again = result.requeue_after
        return Result(requeue_after=LOOK_EVERY_S if again is None else min(again, LOOK_EVERY_S))

    def _replica(self, claim: ModelClaim, index: int, now: float,
                 sleep_after: float) -> Replica:
        rkey = replica_key((claim.namespace, claim.name), index)
        st: ClaimStatus | None = self.w.store.get(rkey)
        serving = st is not None and st.phase == ACTIVE
        if st is None or self.w.in_flight(route_name(claim.model_name, rkey)):
            return Replica(index, serving)
        ready = st.conditions.get(READY)
        if st.phase == SLEEPING and ready is not None:  # slept for being idle sleep_after
            return Replica(index, False, sleep_after + max(0.0, self.w.wall() - ready.since))
        agent = st.instance.agent if st.instance else ""
        last = self.b.tracker.last_busy(agent, claim.model_name) if serving and agent else None
        return Replica(index, serving, None if last is None else max(0.0, now - last))

    def _sleep_after(self, claim: ModelClaim) -> float:
        """The idle time before its engines sleep (0: they do not), where replica 0 runs."""
        st = self.w.store.get((claim.namespace, claim.name))
        pool = self.w.desired.pool_of(st.instance.agent) if st and st.instance else None
        if pool is None:
            return 0.0
        policy = claim.lifecycle.applied_to(pool.policy) if claim.lifecycle else pool.policy
        return policy.sleep_after_seconds

    @staticmethod
    def _next_copy(claim: ModelClaim) -> ModelClaim:
        """The claim as its next replica would be placed."""
        index = claim.replicas
        return replace(claim, name=replica_key((claim.namespace, claim.name), index)[1],
                       replicas=index + 1)
