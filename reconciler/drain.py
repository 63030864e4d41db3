"""Deleting a claim: off the route, let requests finish, stop the engine, forget the claim.

A claim whose manifest is gone (or an engine whose claim_ref names no claim) is reconciled into
its absence, as the guide's finalizer does: the claim is taken off the route first (its status
is marked deleted, which removes its route), its engine may finish the requests in progress
(requests running + waiting in the agent's snapshot) for up to 90 s from the deletion, and is
then stopped (a ``DrainTimedOut`` event when requests were still in progress). A sleeping,
starting or failed engine is stopped at once. Only then is the status dropped, and the claims
waiting for room are looked at again. A replica that a claim no longer asks for
(``replicas`` lowered, ``reconciler.replicas``) is drained the same way.
"""

from __future__ import annotations

import logging

from agent_client import AgentUnreachable, Reply
from reconciler.context import Deps
from reconciler.desired import ClaimKey, key_text
from reconciler.replicas import route_name
from reconciler.runtime.controller import Result

log = logging.getLogger("reconciler.drain")

DRAIN_POLL_S = 0.5


class Drain:
    def __init__(self, deps: Deps) -> None:
        self.w, self.b = deps.reader, deps.books
        self._since: dict[ClaimKey, float] = {}  # clock time the deletion was first seen

    def forget(self, key: ClaimKey) -> None:
        self._since.pop(key, None)

    async def reconcile(self, key: ClaimKey) -> Result:
        st = self.w.store.get(key)
        # Fresh snapshots of the agents that may run the claim's engine: where its status
        # places it, and where the (cached) snapshots show one.
        seen = await self.w.world()
        where = {a for a, _ in seen.engines_of(key)}
        if st is not None and st.instance is not None:
            where.add(st.instance.agent)
        for agent in where:
            self.w.cache.invalidate(agent)
        world = await self.w.world(focus=where)
        found = world.engines_of(key)
        if st is None and not found:
            self._since.pop(key, None)
            self.w.store.drop(key)  # on Kubernetes: the finalizer goes, whatever held it
            return Result()
        now = world.now
        started = self._since.setdefault(key, now)
        if st is not None:
            st.mark_deleted(self.w.wall())
            # off the route before the engine goes (a replica's own route)
            await self.b.routes_out(route_name(st.model_name, key))
        timeout = self.w.timings.drain_timeout
        waiting: list[str] = []
        for agent, engine in found:
            if not world.agents[agent].ok:
                waiting.append(f"{agent} (not answering)")
                continue
            load = engine.load or 0.0
            if engine.phase == "active" and load > 0:
                if now - started < timeout:
                    waiting.append(f"{agent} ({load:g} requests in progress)")
                    continue
                message = (f"{load:g} requests still in progress on {agent} {timeout:.0f} s "
                           "after the deletion; stopping the engine")
                if st is not None:
                    st.event(self.w.wall(), "DrainTimedOut", message, warning=True)
                else:
                    log.warning("claim %s: %s", key_text(key), message)
            await self._stop(key, agent, engine.model_name)
        if waiting:
            if now - started < timeout + self.w.timings.unreachable_grace:
                return Result(requeue_after=DRAIN_POLL_S)
            log.warning("claim %s: giving up on stopping its engine on %s", key_text(key),
                        ", ".join(waiting))
        if self.w.store.replica_keys(key):  # its replicas drain first (the finalizer waits)
            return Result(requeue_after=DRAIN_POLL_S)
        self.w.store.drop(key)
        self._since.pop(key, None)
        self.b.kick_claims(self.w.waiting_keys())
        return Result()

    async def _stop(self, key: ClaimKey, agent: str, model: str) -> None:
        try:
            reply = await self.w.client(agent).deactivate(model)
        except (AgentUnreachable, LookupError) as err:
            reply = Reply(503, {"message": str(err)})
        self.w.cache.invalidate(agent)
        if not reply.ok:
            raise RuntimeError(f"stopping {model} on {agent} failed: {reply.message}")
        log.info("claim %s: stopped %s on %s", key_text(key), model, agent)
        self.b.wakes.drop(route_name(model, key))
        self.b.reservations.drop(agent, model)
        self.b.kick_kv(agent)
