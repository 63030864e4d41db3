"""The desired state on Kubernetes: ModelClaims, and pool Pods and Deployments as pools.

Fed by four informers (``on_claim``, ``on_pod``, ``on_deployment``, ``on_route``), it answers the
reconcilers exactly as the manifest directory does (``reconciler.desired.Desired``), with the
same ``ModelClaim``, ``WarmPool`` and ``Route`` values, so placement, policy and the door's
routes are one implementation:

* A claim is parsed by the same code as a manifest (``claim_from_object``) and every new version
  goes through ``take_change`` (only perGPU may change; anything else keeps the running spec and
  says so). A claim being deleted (``deletionTimestamp``) is no longer desired: its engine is
  drained, and its finalizer removed only then (``reconciler.kube.status``).
* An agent is a Pod with ``claim.model.aibrix.ai/pool`` that runs and has an IP, reached at
  ``http://<podIP>:<runtime port>`` and named ``<namespace>/<pod>``. It keeps its pool when it
  loses the pool label (the guide: a claim stays on a Pod that loses a label), and takes no new
  claim without ``claim.model.aibrix.ai/enabled: "true"`` (its labels are the Pod's). A Pod that
  stops running, is being deleted or is gone is no agent: its claims are placed elsewhere.
* A pool is ``(namespace, pool label)``; its policy is the JSON annotation on the Deployment
  that carries the pool label (an invalid one is off, with an ``InvalidPoolPolicy`` problem).
* A ModelRoute is taken by the directory mode's rule (``reconciler.kube.route_objects``): an
  invalid one, or one named like a claim's modelName, is a problem and is not served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from reconciler.desired import ClaimKey, Lookups
from reconciler.kube.api import Obj
from reconciler.kube.informer import ObjKey, meta, namespaced_key, obj_key, only_status
from reconciler.kube.route_objects import RouteObjects
from reconciler.footprints import FootprintBook, Measured
from reconciler.model.changes import Taken, take_change, unreadable
from reconciler.model.estimated import re_estimate, with_estimate
from reconciler.model.manifests import (
    CLAIM_KIND,
    DRAINING_LABEL,
    POOL_LABEL,
    AgentRef,
    ManifestError,
    ModelClaim,
    Problem,
    WarmPool,
    claim_from_object,
    pool_from_deployment,
)
from reconciler.model.policy import INVALID_POOL_POLICY

log = logging.getLogger("reconciler.kube.desired")

RUNTIME_PORT_NAME = "runtime"
DEFAULT_RUNTIME_PORT = 8080
WAKE_PREFIX = "wake.modelclaim.aibrix.ai/"
ROUTE_PREFIX = "route.claim.model.aibrix.ai/"


def agent_name(namespace: str, pod: str) -> str:
    return f"{namespace}/{pod}"


def pod_of(agent: str) -> tuple[str, str]:
    namespace, _, pod = agent.partition("/")
    return namespace, pod


@dataclass(frozen=True)
class PodAgent:
    """What the reconciler needs of a pool Pod."""

    namespace: str
    name: str
    pool: str
    labels: Mapping[str, str]
    url: str | None  # None: not running with an IP
    annotations: Mapping[str, str]


def runtime_port(pod: Obj, default: int = DEFAULT_RUNTIME_PORT) -> int:
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == RUNTIME_PORT_NAME and isinstance(port.get("containerPort"),
                                                                     int):
                return int(port["containerPort"])
    return default


def pod_agent(pod: Obj, pool: str, default_port: int = DEFAULT_RUNTIME_PORT) -> PodAgent:
    """A pool Pod as an agent while it runs with an IP. One being deleted (its grace period,
    the agent's ``preStop`` waiting) drains: it reads as labelled
    ``claim.model.aibrix.ai/draining: "true"``, so nothing new goes there and its claims move
    away make before break (``reconciler.moving``) while it still serves."""
    m = meta(pod)
    status = pod.get("status") or {}
    ip = status.get("podIP")
    running = status.get("phase") == "Running" and bool(ip)
    host = f"[{ip}]" if ip and ":" in str(ip) else ip
    url = f"http://{host}:{runtime_port(pod, default_port)}" if running else None
    labels = dict(m.get("labels") or {})
    if m.get("deletionTimestamp"):
        labels[DRAINING_LABEL] = "true"
    return PodAgent(str(m.get("namespace") or "default"), str(m.get("name") or ""), pool,
                    labels, url, dict(m.get("annotations") or {}))


class KubeDesired(Lookups):
    """Claims, agents and pools from the informers' objects."""

    def __init__(self, *, default_port: int = DEFAULT_RUNTIME_PORT) -> None:
        super().__init__()
        self.default_port = default_port
        self._objects: dict[ClaimKey, Obj] = {}  # every claim object, being deleted or not
        self._pods: dict[ObjKey, PodAgent] = {}
        self._deployments: dict[ObjKey, WarmPool] = {}
        self._claim_listeners: list[Callable[[ClaimKey], None]] = []
        self._agent_listeners: list[Callable[[set[str]], None]] = []
        self._pod_listeners: list[Callable[[PodAgent | None, PodAgent | None], None]] = []
        self._pending: set[str] | None = None  # agents changed since the rebuild was asked
        self._policy_listeners: list[Callable[[str, str, str], None]] = []
        self.route_objects = RouteObjects()
        self._route_problems: tuple[Problem, ...] = ()
        self._routes_due = False  # the routes are to be taken again at the loop's next turn
        self._route_listeners: list[Callable[[], None]] = []
        # footprints measured on engines of claims without perGPU (in memory: the reconciler's
        # Pod keeps no state directory; a restarted one measures the running engines again)
        self.footprints = FootprintBook(None)

    # ---- more listeners ---------------------------------------------------------------------

    def on_claim_changed(self, listener: Callable[[ClaimKey], None]) -> None:
        self._claim_listeners.append(listener)

    def on_agents_changed(self, listener: Callable[[set[str]], None]) -> None:
        self._agent_listeners.append(listener)

    def on_invalid_policy(self, listener: Callable[[str, str, str], None]) -> None:
        """``listener(namespace, deployment, why)`` when a pool's policy becomes invalid."""
        self._policy_listeners.append(listener)

    def on_routes_changed(self, listener: Callable[[], None]) -> None:
        """``listener()`` after the routes were taken again (``routes`` and the problems)."""
        self._route_listeners.append(listener)

    def on_pod_changed(self, listener: Callable[[PodAgent | None, PodAgent | None],
                                                None]) -> None:
        self._pod_listeners.append(listener)

    # ---- claims -----------------------------------------------------------------------------

    def object(self, key: ClaimKey) -> Obj | None:
        return self._objects.get(key)

    def generation(self, key: ClaimKey) -> int | None:
        gen = meta(self._objects.get(key)).get("generation")
        return int(gen) if isinstance(gen, int) else None

    def on_claim(self, old: Obj | None, new: Obj | None) -> None:
        key = namespaced_key(new or old or {})
        if old is not None and new is not None and only_status(old, new):
            self._objects[key] = new  # our own status write: nothing to reconcile
            return
        if new is None:
            self._objects.pop(key, None)
            self._spec_problems.pop(key, None)
            self._set_claim(key, None)
        else:
            self._objects[key] = new
            running = self.claims.get(key)
            taken = self._take(running, new)
            if taken is None:
                self._set_claim(key, None)
            else:
                if taken.problem is not None:
                    self._spec_problems[key] = taken.problem
                else:
                    self._spec_problems.pop(key, None)
                deleting = bool(meta(new).get("deletionTimestamp"))
                self._set_claim(key, None if deleting else taken.claim)
        for listener in self._claim_listeners:
            listener(key)

    def _take(self, running: ModelClaim | None, obj: Obj) -> Taken | None:
        try:
            declared = with_estimate(claim_from_object(obj), self.footprints.lookup, read=False)
            taken = take_change(running, declared)
            if taken.problem is not None:  # the running version kept: its own figures
                taken = Taken(re_estimate(taken.claim, self.footprints.lookup, read=False),
                              taken.problem)
            return taken
        except ManifestError as bad:
            key = obj_key(obj)
            log.warning("claim %s/%s: %s: %s", key[0], key[1], bad.reason, bad)
            if running is None:
                self._spec_problems[(key[0] or "default", key[1])] = Problem(
                    CLAIM_KIND, key[1], bad.reason, str(bad), key[0])
                return None
            return unreadable(running, bad.reason, str(bad))

    def measured(self, artifact: str, args: Mapping[str, str], measured: Measured) -> bool:
        """An engine of a claim without perGPU was measured: every claim of the same artifact
        and arguments carries the figure from now on (True: figures changed)."""
        if not self.footprints.observe(artifact, args, measured):
            return False
        for key, claim in list(self.claims.items()):
            if claim.artifact_url == artifact and dict(claim.engine_args) == dict(args):
                self._set_claim(key, re_estimate(claim, self.footprints.lookup, read=False))
                for listener in self._claim_listeners:
                    listener(key)
        return True

    def _set_claim(self, key: ClaimKey, claim: ModelClaim | None) -> None:
        if claim is not None:
            claim = self.scaled(key, claim)  # copies by demand: the count chosen stays
        old = self.claims.pop(key, None)
        if old != claim:
            self.claims_version += 1
        if old is not None and self._by_model.get(old.model_name) == key:
            del self._by_model[old.model_name]
        if claim is not None:
            self.claims[key] = claim
            self._by_model.setdefault(claim.model_name, key)
        names = self.route_objects.names
        if names and ((old is not None and old.model_name in names)
                      or (claim is not None and claim.model_name in names)):
            self._take_routes_soon()  # a route named like this claim's model may clash now

    # ---- routes -----------------------------------------------------------------------------

    def on_route(self, old: Obj | None, new: Obj | None) -> None:
        if self.route_objects.change(old, new):
            self._take_routes_soon()

    def _take_routes_soon(self) -> None:
        """Take the routes once at the loop's next turn, however many changes came before it
        (a relist of a hundred routes parses each once, not a hundred times)."""
        if not self._routes_due:
            self._routes_due = True
            asyncio.get_running_loop().call_soon(self._take_routes)

    def _take_routes(self) -> None:
        if not self._routes_due:
            return
        self._routes_due = False
        before = set(self._route_problems)
        self.routes, self._route_problems = self.route_objects.take(self._by_model)
        for problem in sorted(set(self._route_problems) - before, key=str):
            log.warning("route not taken: %s", problem)
        for listener in self._route_listeners:
            listener()

    @property
    def route_problems(self) -> tuple[Problem, ...]:
        """Why each route object not served is not (``InvalidRoute``, ``Duplicate``)."""
        return self._route_problems

    @property
    def problems(self) -> tuple[Problem, ...]:
        """Computed when read (a relist of ten thousand claims must not build it each time)."""
        held = [p for c in self.claims.values() for p in c.problems]
        pools = [Problem(p.source_kind, p.name, INVALID_POOL_POLICY,
                         f"policy turned off: {p.policy_problem}", p.namespace)
                 for p in self._deployments.values() if p.policy_problem is not None]
        return tuple(held) + tuple(self._spec_problems.values()) + tuple(pools) \
            + self._route_problems

    # ---- pods and deployments ---------------------------------------------------------------

    def pod(self, namespace: str, name: str) -> PodAgent | None:
        return self._pods.get((namespace, name))

    def on_pod(self, old: Obj | None, new: Obj | None) -> None:
        key = obj_key(new or old or {})
        before = self._pods.get(key)
        if new is None:
            after = None
        else:
            pool = (meta(new).get("labels") or {}).get(POOL_LABEL)
            if pool is None and before is None:
                return  # not a pool Pod, and never was one
            after = pod_agent(new, str(pool if pool is not None else before.pool
                                       if before is not None else ""), self.default_port)
        if after is None:
            self._pods.pop(key, None)
        else:
            self._pods[key] = after
        for listener in self._pod_listeners:
            listener(before, after)
        if (before is None) != (after is None) or (
                before is not None and after is not None
                and (before.url, before.labels, before.pool) != (after.url, after.labels,
                                                                 after.pool)):
            self._rebuild({agent_name(*key)})

    def _rebuild(self, changed: set[str]) -> None:
        """Rebuild once at the loop's next turn, however many changes came before it (a relist
        of a thousand Pods is one rebuild, not a thousand)."""
        if self._pending is None:
            self._pending = set(changed)
            asyncio.get_running_loop().call_soon(self._rebuild_now)
        else:
            self._pending |= changed

    def flush(self) -> None:
        """Rebuild (and take the routes) now if pending (tests, and before the controllers
        start)."""
        if self._pending is not None:
            self._rebuild_now()
        self._take_routes()

    def on_deployment(self, old: Obj | None, new: Obj | None) -> None:
        key = obj_key(new or old or {})
        before: WarmPool | None = self._deployments.get(key)
        pool: WarmPool | None = None
        if new is not None and POOL_LABEL in (meta(new).get("labels") or {}):
            try:
                pool = pool_from_deployment(new, ())
            except ManifestError as bad:
                log.warning("deployment %s/%s: %s", key[0], key[1], bad)
        if pool is None:
            self._deployments.pop(key, None)
        else:
            self._deployments[key] = pool
        if before != pool:
            problem = pool.policy_problem if pool is not None else None
            if problem is not None and (before is None or before.policy_problem != problem):
                for listener in self._policy_listeners:
                    listener(key[0], key[1], problem)
            self._rebuild(set())

    def _pool_label(self, deployment: ObjKey, pool: WarmPool) -> str:
        return str(pool.labels.get(POOL_LABEL) or deployment[1])

    def _rebuild_now(self) -> None:
        """Pools and agents again (a Pod came, went or changed what matters, or a policy)."""
        if self._pending is None:
            return
        changed, self._pending = self._pending, None
        policies: dict[tuple[str, str], WarmPool] = {}
        for key, dep in sorted(self._deployments.items()):
            policies.setdefault((key[0], self._pool_label(key, dep)), dep)
        members: dict[tuple[str, str], list[AgentRef]] = {}
        for (ns, name), pod in sorted(self._pods.items()):
            if pod.url is not None:
                members.setdefault((ns, pod.pool), []).append(
                    AgentRef(agent_name(ns, name), pod.url, pod.labels))
        pools = []
        for (ns, label), refs in sorted(members.items()):
            owner = policies.get((ns, label))
            if owner is not None:
                pools.append(WarmPool(label, ns, tuple(refs), owner.policy, owner.labels,
                                      owner.policy_problem, owner.gpus_per_agent, "Deployment"))
            else:
                pools.append(WarmPool(label, ns, tuple(refs)))
        before = {n: (a.url, dict(a.labels), p.policy) for n, (a, p) in self._agents.items()}
        self.pools = tuple(pools)
        self._agents = {a.name: (a, p) for p in self.pools for a in p.agents}
        after = {n: (a.url, dict(a.labels), p.policy) for n, (a, p) in self._agents.items()}
        changed |= {n for n in before.keys() | after.keys() if before.get(n) != after.get(n)}
        if before.keys() != after.keys() or any(before[n][0] != after[n][0] for n in after
                                                if n in before):
            for listener in self._pool_listeners:
                listener()
        if changed:
            for agent_listener in self._agent_listeners:
                agent_listener(changed)
