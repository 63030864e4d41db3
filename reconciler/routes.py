"""Routes and wake requests: what the gateway reads, and what it asks for.

A claim's route (the guide's ``route.claim.model.aibrix.ai/<claim>`` annotation) says where its
model is served: ``{model, agent, host, port, state, reason, wakeByRequest}``, state ``active``,
``activating``, ``sleeping`` or ``failed``. The table is derived on every read from the claim
statuses, the agents' health and the models held off the route, so it can never disagree with
them: a port is given only while the claim is Active, its agent answers, and no sleep is being
prepared for it (``RouteHolds``: a model is taken off the route before it is put to sleep).

``WakeBook`` holds the wake requests (the guide's ``wake.modelclaim.aibrix.ai/<claim>``): one per
model, repeated requests collapse into the first, and a request expires after five minutes.
The claim reconciler serves them and removes them once the model serves, the wake failed, or
the request expired.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from contract.reasons import AGENT_NOT_READY
from reconciler.desired import ClaimKey
from reconciler.replicas import route_name
from reconciler.status import (
    ACTIVATING,
    ACTIVE,
    ENGINE_SLEEPING,
    FAILED,
    PENDING,
    READY,
    SCHEDULED,
    SLEEPING,
    WAITING_FOR_ROOM,
    ClaimStatus,
)

WAKE_TTL_S = 300.0


@dataclass
class WakeRequest:
    model: str
    key: ClaimKey
    at: float  # clock time of the first request
    wall: float  # wall time of the first request
    waking: bool = False  # the agent was asked to wake the engine
    repeats: int = 0
    # models on its agent to put to sleep first for its room, when they may be (a route's
    # made-room choice, ``reconciler.door.routing``); () : the reconciler's own order
    victims: tuple[str, ...] = ()


class WakeBook:
    """Wake requests by model name; ``ttl`` seconds each."""

    def __init__(self, ttl: float = WAKE_TTL_S) -> None:
        self.ttl = ttl
        self._by_model: dict[str, WakeRequest] = {}

    def request(self, model: str, key: ClaimKey, now: float, wall: float,
                victims: tuple[str, ...] = ()) -> tuple[WakeRequest, bool]:
        """Record a wake request; (the request, True when it is new). A repeat that names
        victims gives them to a request that named none."""
        old = self._by_model.get(model)
        if old is not None and not self.expired(old, now):
            old.repeats += 1
            if victims and not old.victims:
                old.victims = victims
            return old, False
        req = self._by_model[model] = WakeRequest(model, key, now, wall, victims=victims)
        return req, True

    def get(self, model: str) -> WakeRequest | None:
        return self._by_model.get(model)

    def expired(self, req: WakeRequest, now: float) -> bool:
        return now - req.at >= self.ttl

    def drop(self, model: str) -> None:
        self._by_model.pop(model, None)

    def models(self) -> list[str]:
        return sorted(self._by_model)


class RouteHolds:
    """Models kept off the route while the reconciler prepares to put them to sleep.
    ``listen``: called after every hold and release (the front door's held requests look
    again)."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._listeners: list[Callable[[], None]] = []

    def listen(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def hold(self, model: str) -> None:
        self._held[model] = self._held.get(model, 0) + 1
        self._changed()

    def release(self, model: str) -> None:
        left = self._held.get(model, 0) - 1
        if left > 0:
            self._held[model] = left
        else:
            self._held.pop(model, None)
        self._changed()

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def __contains__(self, model: object) -> bool:
        return model in self._held


@dataclass(frozen=True)
class Route:
    model: str
    claim: str
    agent: str
    host: str
    port: int
    state: str
    reason: str
    wake_by_request: bool
    wake_requested: bool = False
    replica: int = 0  # the claim's replica this route serves (``reconciler.replicas``)

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "model": self.model, "claim": self.claim, "agent": self.agent, "host": self.host,
            "port": self.port, "state": self.state, "reason": self.reason,
            "wakeByRequest": self.wake_by_request, "wakeRequested": self.wake_requested}
        if self.replica:
            out["replica"] = self.replica
        return out


def route_of(st: ClaimStatus, urls: Mapping[str, str], healthy: Callable[[str], bool],
             holds: RouteHolds, wakes: WakeBook) -> Route | None:
    """A claim's route now; None for a claim being deleted (already off the route)."""
    if st.deleted is not None:
        return None
    inst = st.instance
    agent = inst.agent if inst else ""
    host = urlparse(urls.get(agent, "")).hostname or "" if agent else ""
    ready_reason = st.reason(READY)
    port, state, reason = 0, "activating", ready_reason
    named = route_name(st.model_name, st.key)  # a replica's own (``reconciler.replicas``)
    if st.phase == ACTIVE:
        if named in holds:
            state, reason = "sleeping", ENGINE_SLEEPING
        elif not healthy(agent):
            reason = AGENT_NOT_READY
        else:
            port, state, reason = inst.port if inst else 0, "active", ""
    elif st.phase == SLEEPING:
        state = "sleeping"
        reason = WAITING_FOR_ROOM if ready_reason == WAITING_FOR_ROOM else ENGINE_SLEEPING
    elif st.phase == FAILED:
        state = "failed"
    elif st.phase == PENDING:
        reason = st.reason(SCHEDULED) or ready_reason
    elif st.phase != ACTIVATING:
        reason = ready_reason
    return Route(st.model_name, f"{st.namespace}/{st.claim_name}", agent, host, port, state,
                 reason, st.engine == "vllm", wakes.get(named) is not None, st.index)


def route_table(statuses: Iterable[ClaimStatus], urls: Mapping[str, str],
                healthy: Callable[[str], bool], holds: RouteHolds,
                wakes: WakeBook) -> list[Route]:
    routes = (route_of(st, urls, healthy, holds, wakes) for st in statuses)
    return sorted((r for r in routes if r is not None), key=lambda r: (r.model, r.replica))
