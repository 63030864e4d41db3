"""The Kubernetes run mode: ``runtime-agent reconcile --kubernetes``.

    ModelClaims --Informer--> KubeDesired --keys--> the core (``reconciler.core``): placement,
    Pods -------Informer--/       |                  KV division, sleep, wake and drain, the
    Deployments -Informer-/       |                  same code as the directory mode; the door
    ModelRoutes -Informer-/       |                  serves the routes taken as from a directory
                                  v
    KubeStatusStore --status subresource, finalizers--> API server
    RoutePublisher --route and wake annotations on Pods--> API server
    RouteStatusWriter --ModelRoute candidates and conditions (status subresource)--> API server
    EventRecorder --Events--> API server

Every replica serves ``/healthz`` and ``/metrics`` at once and campaigns for the Lease; only the
leader lists and watches, reconciles and writes. A replica that loses the Lease exits (its
Deployment restarts it as a standby); one that is stopped releases the Lease after its last
writes, so a standby takes over within a retry period.

With ``door`` settings (``reconcile --kubernetes --door-port P``) every replica listens with the
front door (``reconciler.door``), beside the AIBrix gateway: both read the same routes (the
gateway from the Pod annotations ``RoutePublisher`` writes, the door from ``route_of`` itself)
and reach the engine at the Pod's IP and the route's port. Only the leader answers, and only
once its informers have synced: a standby knows no claims, statuses or routes, so its door
answers every request 503 ``not_leading`` with ``Retry-After`` rather than route from an empty
world. The door's requests in flight feed the idle check as in the local mode (``Core``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from contract.clock import Clock, LoopClock
from reconciler.core import Core, CoreSettings
from reconciler.desired import ClaimKey
from reconciler.door.settings import DoorSettings
from reconciler.kube.api import CLAIMS, DEPLOYMENTS, PODS, ROUTES, KubeApi, Obj, connect
from reconciler.kube.desired import DEFAULT_RUNTIME_PORT, KubeDesired
from reconciler.kube.events import EventRecorder, ObjectRef
from reconciler.kube.informer import Informer, meta
from reconciler.kube.leader import ElectionSettings, Elector
from reconciler.kube.route_status import RouteStatusWriter
from reconciler.kube.routes import RoutePublisher
from reconciler.kube.status import KubeStatusStore
from reconciler.model.manifests import POOL_LABEL
from reconciler.runtime.heap import frozen_heap
from reconciler.runtime.loop import run as run_on_uvloop
from reconciler.status import ClaimEvent, ClaimStatus

log = logging.getLogger("reconciler.kube.app")


@dataclass(frozen=True)
class KubeSettings:
    # The resync is a safety net (watches and the agents' events carry every change): every
    # claim once in 30 minutes, spread out; the agents' event long-polls last 55 s (limit 60).
    core: CoreSettings = field(default_factory=lambda: CoreSettings(
        host="0.0.0.0", resync_interval=1800.0, feed_wait=55, kv_workers=16))
    kubeconfig: str | None = None
    context: str | None = None
    namespace: str | None = None  # watch one namespace (None: all)
    lease_namespace: str = "default"
    identity: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    leader_election: bool = True
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    watch_timeout: int = 300
    runtime_port: int = DEFAULT_RUNTIME_PORT
    door: DoorSettings | None = None  # the front door (None: off); it answers on the leader
    route_status_interval: float = 0.5  # at most one pass of ModelRoute status writes per this


class KubeApp(Core):
    """One replica. ``await run()`` until ``stop()``; answers the process's exit code."""

    def __init__(self, settings: KubeSettings, api: KubeApi, *,
                 clock: Clock | None = None) -> None:
        self.settings = settings
        self.api = api
        clock = clock or LoopClock()
        desired = KubeDesired(default_port=settings.runtime_port)
        self.recorder = EventRecorder(api, clock=clock)
        store = KubeStatusStore(api, desired, clock.wall, on_event=self._claim_event)
        self._leading = False
        self._serving = False  # leading, synced and not stopping: the door answers
        self._stop = asyncio.Event()
        self._exit = 0
        super().__init__(settings.core, desired, store, clock=clock, door=settings.door,
                         standby=self._standby)
        self.kube_desired = desired
        self.kube_store = store
        self.publisher = RoutePublisher(api, desired, self.deps, self.clock)
        self.deps.books.routes_out = self.publisher.sync_model
        store.on_mark = self.publisher.mark
        store.publish_route = self.publisher.publish
        ns, w = settings.namespace, settings.watch_timeout
        self.informers = [
            Informer(api, CLAIMS, desired.on_claim, namespace=ns, watch_timeout=w, clock=clock),
            Informer(api, PODS, desired.on_pod, namespace=ns, watch_timeout=w, clock=clock),
            Informer(api, DEPLOYMENTS, desired.on_deployment, namespace=ns,
                     label_selector=POOL_LABEL, watch_timeout=w, clock=clock),
            Informer(api, ROUTES, desired.on_route, namespace=ns, watch_timeout=w,
                     clock=clock, optional=True)]
        self.route_status = RouteStatusWriter(api, desired, self.clock, self._route_warning,
                                              settings.route_status_interval)
        desired.on_routes_changed(self.route_status.mark)
        desired.on_claim_changed(self._claim_changed)
        desired.on_agents_changed(self._agents_changed)
        desired.on_invalid_policy(self._invalid_policy)
        self.leader = Gauge("reconciler_leader", "1 while this replica leads (and writes).",
                            registry=self.registry)
        self.elector = Elector(api, ElectionSettings(
            settings.lease_namespace, identity=settings.identity,
            lease_duration=settings.lease_duration, renew_deadline=settings.renew_deadline,
            retry_period=settings.retry_period), on_started=self._lead,
            on_stopped=self._lost, clock=self.clock)

    # ---- keys -------------------------------------------------------------------------------

    def _claim_changed(self, key: ClaimKey) -> None:
        obj = self.kube_desired.object(key)
        if obj is not None:
            self.kube_store.note_version(key, str(meta(obj).get("resourceVersion") or ""))
        self.claim_queue.add(key)
        self.publisher.mark(key)
        self.route_status.mark()  # a claim's labels or figures may change a route's candidates

    def _agents_changed(self, agents: set[str]) -> None:
        """Pods came, went or changed: the claims placed on them, and those waiting for room."""
        keys = {st.key for st in self.kube_store.values()
                if st.instance is not None and st.instance.agent in agents}
        keys |= set(self.deps.reader.waiting_keys())
        for agent in agents:
            obs = self.cache.last(agent)
            if obs is not None:
                keys |= set(obs.by_claim)
            if self.desired.agent(agent) is not None:
                self.kv_queue.add(agent)
        for key in sorted(keys):
            self.claim_queue.add(key)
            self.publisher.mark(key)

    def _claim_event(self, st: ClaimStatus, event: ClaimEvent) -> None:
        if self._leading:
            self.recorder.record(ObjectRef(CLAIMS.api_version, CLAIMS.kind, st.namespace,
                                           st.claim_name, st.uid), event.type, event.reason,
                                 event.message)

    def _route_warning(self, obj: Obj, reason: str, message: str) -> None:
        if self._leading:
            m = meta(obj)
            self.recorder.record(ObjectRef(ROUTES.api_version, ROUTES.kind,
                                           str(m.get("namespace") or "default"),
                                           str(m.get("name") or ""), str(m.get("uid") or "")),
                                 "Warning", reason, message)

    def _invalid_policy(self, namespace: str, name: str, why: str) -> None:
        if self._leading:
            self.recorder.record(ObjectRef(DEPLOYMENTS.api_version, DEPLOYMENTS.kind,
                                           namespace, name), "Warning", "InvalidPoolPolicy",
                                 f"policy turned off: {why}")

    # ---- leading ----------------------------------------------------------------------------

    async def _lead(self) -> None:
        """Leadership begins: list and watch, then reconcile and write."""
        self._leading = True
        self.leader.set(1)
        for informer in self.informers:
            informer.start()
        await asyncio.gather(*(i.synced.wait() for i in self.informers))
        self.kube_desired.flush()
        self.recorder.start()
        self.kube_store.start()
        self.publisher.start()
        await self.start_core()
        self.route_status.start()
        self.publisher.mark_all()
        self._serve(not self._stop.is_set())
        log.info("leading: %d claims, %d agents", len(self.desired.claims),
                 len(self.desired.agents()))

    def _serve(self, serving: bool) -> None:
        """The door answers, or not; requests it holds look again at once (and, when it stops
        answering, are answered 503)."""
        self._serving = serving
        if self.door is not None:
            self.door.changes.bump()

    def _standby(self) -> str | None:
        """Why the door cannot answer now; None on the leader once it has synced."""
        if self._serving:
            return None
        me = self.settings.identity
        if self._stop.is_set():
            return f"This replica of the ModelClaim reconciler ({me}) is shutting down; " \
                "retry: another replica takes over."
        if self._leading:
            return f"This replica of the ModelClaim reconciler ({me}) has just become the " \
                "leader and is still reading the cluster's claims and Pods; retry in a moment."
        return f"This replica of the ModelClaim reconciler ({me}) is not leading: it stands " \
            "by and knows no routes. Retry: the leading replica serves requests."

    async def _lead_alone(self) -> None:
        """Without an election: lead until stopped."""
        await self._lead()
        await asyncio.Event().wait()

    async def _lost(self) -> None:
        self._serve(False)  # another replica may lead soon: route nothing more
        self._exit = 1
        self._stop.set()

    def stop(self) -> None:
        self._serve(False)
        self._stop.set()

    async def run(self) -> int:
        """Serve health, metrics (and the door), campaign, lead; the exit code. ``OSError``
        when a port cannot be listened on."""
        try:
            await self.serve_http()
            await self.start_door()
        except BaseException:  # a port in use: nothing left open (the API client's session)
            await self.stop_http()
            await self.api.close()
            raise
        log.info("replica %s: serving health and metrics on %s:%d%s", self.settings.identity,
                 self.settings.core.host, self.port,
                 f", the front door on port {self.door.port}" if self.door else "")
        if self.settings.leader_election:
            campaign = asyncio.ensure_future(self.elector.run())
        else:
            campaign = asyncio.ensure_future(self._lead_alone())
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({campaign, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            campaign.cancel()
            stopping.cancel()
            await asyncio.wait({campaign, stopping})
            await self._shutdown()
        return self._exit

    async def _shutdown(self) -> None:
        """Controllers first (in-flight reconciles finish), then the last writes, then the
        Lease: a standby starts only after this replica wrote everything it decided. The door
        stops first: no new requests, and those in flight get its shutdown grace."""
        self._serve(False)
        await self.stop_door()
        if self._leading:
            await self.stop_core()
            await self.publisher.stop()
            await self.route_status.stop()
            await self.kube_store.stop()
            await self.recorder.stop()
            for informer in self.informers:
                await informer.stop()
            await self.elector.release()
            self._leading = False
            self.leader.set(0)
        await self.stop_http()
        await self.api.close()


def request_counter(registry_holder: list[Counter]) -> Callable[[str, str, int], None]:
    def count(verb: str, resource: str, status: int) -> None:
        if registry_holder:
            registry_holder[0].labels(verb=verb, resource=resource, code=str(status)).inc()
    return count


async def serve_until_signalled(settings: KubeSettings) -> int:
    holder: list[Counter] = []
    api = await connect(settings.kubeconfig, settings.context, request_counter(holder))
    app = KubeApp(settings, api)
    holder.append(Counter("reconciler_kube_requests_total",
                          "Requests to the Kubernetes API server, by verb, resource and code.",
                          ["verb", "resource", "code"], registry=app.registry))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, app.stop)
    try:
        async with frozen_heap():
            return await app.run()
    except OSError as err:  # a port in use: say which, without a stack trace
        door = f" or its front door (port {settings.door.port})" if settings.door else ""
        raise SystemExit(f"runtime-agent reconcile: the reconciler (port {settings.core.port})"
                         f"{door} cannot listen: {err}; choose other ports with --port / "
                         "--door-port") from err


def run_kubernetes(settings: KubeSettings) -> int:
    """Blocking: one replica until SIGTERM (0) or until it loses the Lease (1)."""
    return run_on_uvloop(serve_until_signalled(settings))
