"""KV division: each agent's GPUs divided among its engines' KV caches, applied and confirmed.

A second controller, keyed by agent name. ``reconcile(agent)`` reads a fresh snapshot, asks the
planner for every engine's KV limit (``divide_gpus``: footprints and KV floors first, the rest
to the awake engines by load band, stable within a band), and applies the changes through the
agent's ``kv-limit`` call: every shrink first, each confirmed by the agent's answer
(``applied: true``), and only then the grows, so the limits never add up to more than a card.
A shrink the agent does not confirm stops the round (nothing grows) and the agent is tried
again soon. Each change is a ``KVLimitSet`` event on its claim and its
``status.instances[].kvLimitBytes``; an engine that waits for its limit before going on the
route is looked at again.

It runs after every engine transition on the agent (the events feed), after the claim
reconciler starts, sleeps, wakes or stops an engine there, and every ``kv_resync`` seconds
while engines take requests (the load moves between them), every ``kv_idle_resync`` seconds
while they are all idle.

A limit the agent cannot write yet (a booting engine has no KV segment) is kept by the agent
and applied the moment the segment appears, so it counts as confirmed for ordering.
"""

from __future__ import annotations

import logging

from contract.quantity import gib
from agent_client import AgentUnreachable
from reconciler.context import Deps
from reconciler.observe import EngineObs
from reconciler.planning.kv_division import LimitChange, divide_gpus, order_changes
from reconciler.runtime.controller import Result
from reconciler.status import ClaimStatus

log = logging.getLogger("reconciler.kv")


class KvReconciler:
    """Reconciles one agent's KV limits by agent name; give it to a ``Controller``."""

    def __init__(self, deps: Deps) -> None:
        self.w, self.b = deps.reader, deps.books

    async def reconcile(self, agent: str) -> Result:
        if self.w.pool_of(agent) is None:
            return Result()
        obs = await self.w.cache.fresh(agent)
        if not obs.ok:
            return Result(requeue_after=self.w.timings.kv_resync)
        cand = self.w.candidate_of(obs)
        if cand is None:
            return Result()
        engines = {e.model_name: e for e in obs.engines
                   if e.phase not in ("failed", "stopping", "stopped") and e.claim_ref}
        planned = {m: v for m, v in divide_gpus(cand.gpus, cand.policy).items() if m in engines}
        current = {m: engines[m].kv_requested for m in planned}
        shrinks, grows = order_changes(current, planned)
        changed = False
        for change in shrinks:
            if not await self._apply(agent, engines[change.engine], change):
                self.w.cache.invalidate(agent)
                return Result(requeue_after=1.0)  # no grow before every shrink holds
            changed = True
        for change in grows:
            changed |= await self._apply(agent, engines[change.engine], change)
        if changed:
            self.w.cache.invalidate(agent)
        for model, engine in engines.items():
            st = self._status(engine)
            if st is not None:
                st.set_kv_limit(agent, planned.get(model, engine.kv_requested))
        awake = [e for e in engines.values() if e.phase == "active"]
        if not awake:
            return Result()
        # Load moves between busy engines without an event, so a busy agent is looked at often;
        # an idle one (no request anywhere) rarely: its division would not change, and a
        # thousand idle agents must cost next to nothing.
        busy = any(e.load is None or e.load > 0 for e in awake)
        return Result(requeue_after=self.w.timings.kv_resync if busy
                      else self.w.timings.kv_idle_resync)

    def _status(self, engine: EngineObs) -> ClaimStatus | None:
        if engine.claim_ref is None:
            return None
        st = self.w.store.get(engine.claim_ref)
        return st if st is not None and st.model_name == engine.model_name else None

    async def _apply(self, agent: str, engine: EngineObs, change: LimitChange) -> bool:
        try:
            reply = await self.w.client(agent).kv_limit(change.engine, change.new)
        except (AgentUnreachable, LookupError) as err:
            log.warning("kv limit of %s on %s: %s", change.engine, agent, err)
            return False
        pending = reply.ok and not reply.in_force and not engine.kv_present
        if not (reply.in_force or pending):
            log.warning("kv limit of %s on %s not confirmed: %s", change.engine, agent,
                        reply.message)
            return False
        st = self._status(engine)
        if st is not None:
            inst = st.instance
            before = inst.kv_limit_bytes if inst is not None and inst.agent == agent else None
            # "was" only for a limit this claim set before: the engine's own size is no limit
            was = f" (was {gib(before)})" if before is not None else ""
            held = "" if reply.in_force else "; applied once the engine's KV cache exists"
            applied = reply.body.get("applied_bytes")
            clamped = f", held at {gib(applied)} (its capacity)" \
                if reply.body.get("clamped") and isinstance(applied, int) else ""
            st.set_kv_limit(agent, change.new)
            st.event(self.w.wall(), "KVLimitSet", f"KV limit {gib(change.new)} on {agent}"
                     f"{was}{clamped}{held}")
            if engine.phase == "active":
                self.b.kick_claim(st.key)
        return True
