"""Make before break (issue 25, items 3 and 4): a claim whose engine runs on a draining agent
moves to another without a gap in service.

An agent drains while its Pod (or, in a claims directory, its entry in the WarmPool) carries
the label ``claim.model.aibrix.ai/draining: "true"`` (ours; ``Candidate.draining``): nothing
new is placed on it, and every claim whose engine runs there moves, one step per look:

1. **Start first.** An engine of the claim is started on another agent's free room (placed as
   any claim, apart from its other replicas, never on a draining agent; nothing is slept for
   it), while the claim's own engine keeps serving, awake or asleep (a sleeping one still
   wakes where it is for the requests that come meanwhile). The status lists the new engine as
   a second instance with ``moving: true``; a ``Moving`` event says from where to where.
   Without room anywhere the claim stays where it is, saying why (``MoveWaiting``), and tries
   again.
2. **Switch when ready.** Once the new engine is active and ready, it becomes the claim's
   engine: its instance, so its route and the door's requests from that moment (``Moved``).
3. **Then break.** The old engine finishes its requests and is stopped: once a snapshot taken
   at least ``SETTLE_S`` after the switch shows nothing running or waiting in it, or after
   ``DRAIN_S`` (the deletion drain's 90 s), whichever comes first.

A new engine that fails is stopped (``MoveFailed``) and the claim stays where it is; the next
look tries again. The steps are read from the world each time (which engine of the claim runs
where, and which agents drain), so a reconciler started again mid-move goes on with it: an
engine of the claim on a non-draining agent while its own drains is the move's, not a second
engine to stop. An engine that failed for good moves as before (stop, then start: it cannot
serve meanwhile; the ``Moving`` reason keeps its seed meaning there).
"""

from __future__ import annotations

import logging

from agent_client import AgentUnreachable
from reconciler.context import Deps
from reconciler.desired import ClaimKey, claim_key
from reconciler.model.manifests import ModelClaim
from reconciler.observe import EngineObs, World
from reconciler.placing import Placer
from reconciler.status import ClaimStatus

log = logging.getLogger("reconciler.moving")
SETTLE_S = 1.0  # after the switch, requests already sent reach the old engine within this
DRAIN_S = 90.0  # the old engine is stopped after this however busy (the deletion drain's)
POLL_S = 0.5  # a claim that moves is looked at this often
RETRY_S = 5.0  # a move that found no room, or whose engine failed, is tried again after this
MOVING, MOVED, MOVE_WAITING, MOVE_FAILED = "Moving", "Moved", "MoveWaiting", "MoveFailed"


class Mover:
    def __init__(self, deps: Deps, placer: Placer) -> None:
        self.w, self.b = deps.reader, deps.books
        self.placer = placer
        # claim -> (the agent it moved away from, clock time of the switch)
        self._switched: dict[ClaimKey, tuple[str, float]] = {}
        self._waiting: dict[ClaimKey, float] = {}  # claim -> when a start may be tried again

    @staticmethod
    def draining(world: World, agent: str) -> bool:
        cand = world.candidates.get(agent)
        return cand is not None and cand.draining

    def keeps(self, claim: ModelClaim, st: ClaimStatus, world: World, agent: str,
              engine: EngineObs) -> bool:
        """An engine of the claim besides its own that is not stopped now: the move's new one
        (the claim's own engine drains, this one comes up on an agent that does not), or the
        old one still finishing its requests after the switch."""
        inst = st.instance
        if inst is not None and self.draining(world, inst.agent) \
                and not self.draining(world, agent):
            return True  # being brought up
        if not self.draining(world, agent):
            return False
        now = self.w.clock.now()
        switched = self._switched.get(claim_key(claim))
        at = switched[1] if switched is not None and switched[0] == agent else None
        if at is not None and now - at >= DRAIN_S:
            return False
        seen_at = world.agents[agent].fetched_at
        idle = engine.load == 0 and (at is None or seen_at >= at + SETTLE_S)
        return not idle

    async def step(self, claim: ModelClaim, st: ClaimStatus, world: World, agent: str,
                   engine: EngineObs) -> tuple[bool, float | None]:
        """One step of the claim's move, its engine being ``engine`` on ``agent``: (whether
        the claim's engine was switched, so the caller does not follow the old one; when to
        look again)."""
        key = claim_key(claim)
        others = [(a, e) for a, e in world.engines_of(key)
                  if a != agent and e.model_name == claim.model_name]
        if not self.draining(world, agent):
            left = [a for a, _ in others if self.draining(world, a)]
            if not left:
                self._switched.pop(key, None)
                return False, None
            for old in left:  # the old engine still finishes its requests: the next look
                self.w.cache.invalidate(old)  # reads its agent again, not a cached snapshot
            return False, POLL_S
        target = next(((a, e) for a, e in others if not self.draining(world, a)
                       and world.agents[a].ok), None)
        if target is None:
            return False, await self._start(claim, st, agent)
        to, new = target
        if new.phase == "failed":
            st.event(self.w.wall(), MOVE_FAILED, f"the new engine on {to} failed "
                     f"({new.last_error or 'no reason given'}); {agent} keeps serving",
                     warning=True)
            await self._stop(to, claim.model_name)
            st.set_moving(None)
            self._waiting[key] = self.w.clock.now() + RETRY_S
            return False, RETRY_S
        if new.phase != "active" or not new.ready:
            st.set_moving(to, new.port, new.devices)
            return False, POLL_S
        self._switched[key] = (agent, self.w.clock.now())
        st.set_moving(None)
        st.set_instance(to, new.port, new.devices)
        st.event(self.w.wall(), MOVED, f"moved from {agent} to {to}: {to} serves; the engine on "
                 f"{agent} finishes its requests (up to {DRAIN_S:g} s) and stops")
        self.b.kick_kv(to)
        self.b.kick_kv(agent)
        return True, SETTLE_S

    async def _start(self, claim: ModelClaim, st: ClaimStatus, agent: str) -> float:
        key = claim_key(claim)
        now = self.w.clock.now()
        if self._waiting.get(key, 0.0) > now:
            return self._waiting[key] - now
        got = await self.placer.start_elsewhere(claim, st, agent)
        if isinstance(got, str):
            st.event(self.w.wall(), MOVE_WAITING, f"{agent} drains, and the claim cannot move "
                     f"yet ({got}); it serves there meanwhile")
            self._waiting[key] = now + RETRY_S
            return RETRY_S
        placed, port = got
        self._waiting.pop(key, None)
        st.set_moving(placed.agent, port, placed.devices)
        st.event(self.w.wall(), MOVING, f"moving from {agent} to {placed.agent}, make before "
                 f"break: {agent} serves until the engine on {placed.agent} is ready")
        return POLL_S

    async def _stop(self, agent: str, model: str) -> None:
        try:
            await self.w.client(agent).deactivate(model)
        except (AgentUnreachable, LookupError) as err:
            log.warning("stopping %s on %s: %s", model, agent, err)
        self.w.cache.invalidate(agent)
        self.b.kick_kv(agent)
