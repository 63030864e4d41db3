"""The reconciler's core, the same in both run modes: agents, controllers, feeds, HTTP server.

    desired state (a manifest directory, or the Kubernetes API) --keys--+
    resync ----------------------------------------------TimerSource----+--> claim queue
    agents' events ------------------------------------EventFeedSource--+        |
                                                          \\--> KV queue          v
                                  KvReconciler (per agent) <--+      ClaimReconciler
                                                               agents (HttpAgentClient)

``Core`` is given a ``Desired`` (what is asked) and a ``StatusStore`` (where statuses go: files,
or the Kubernetes status subresource) and wires the one implementation of placement, KV
division, sleep, wake and drain around them. The run modes (``reconciler.local.app`` for a
directory, ``reconciler.kube.app`` for Kubernetes) add their own sources of keys.

With ``door`` settings the core also builds the front door (``reconciler.door``) on its own
``Deps``, and its ``Ledger``'s requests in flight are what the idle check reads before a sleep
(``WorldReader.in_flight``), in both modes alike; a mode starts and stops it (``start_door``,
``stop_door``) and says, with ``standby``, when the replica cannot serve.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from contract.clock import Clock, LoopClock
from reconciler.claims import ClaimReconciler
from guard.tokens import TokenSource
from agent_client import AgentApi, HttpAgentClient, bearer_middleware
from reconciler.context import Deps, Timings
from reconciler.desired import ClaimKey, Desired
from reconciler.door.ledger import Ledger
from reconciler.door.service import FrontDoor
from reconciler.door.settings import DoorSettings
from reconciler.kv import KvReconciler
from reconciler.metrics import ClaimMetrics
from reconciler.observe import IdleTracker, SnapshotCache
from reconciler.runtime.controller import Controller
from reconciler.runtime.metrics import ControllerMetrics
from reconciler.runtime.queue import WorkQueue
from reconciler.runtime.sources import EventFeedSource, TimerSource
from reconciler.server import make_app, serve
from reconciler.store import StatusStore

log = logging.getLogger("reconciler.core")

DEFAULT_PORT = 8081


def scaled_timings() -> Timings:
    """The run modes' timings: snapshots of agents a reconcile does not act on may be 10 s old
    unless an event or a call made them stale (events invalidate them; reservations cover our
    own starts), so a reconcile reads one agent, not every agent of the fleet; an agent whose
    engines are all idle is re-divided every 5 minutes (its division would not change)."""
    return Timings(others_max_age=10.0, kv_idle_resync=300.0)


@dataclass(frozen=True)
class CoreSettings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    resync_interval: float = 300.0  # every claim looked at again, spread over this interval
    workers: int = 32  # reconciles wait on agents (an activate may wait 2 s for its card)
    kv_workers: int = 2
    snapshot_ttl: float = 0.1
    feed_wait: int = 30
    agent_token: TokenSource | None = field(default=None, repr=False)  # sent on every agent call
    timings: Timings = field(default_factory=scaled_timings)
    api_token: TokenSource | None = field(default=None, repr=False)  # asked of this API's callers
    auth_reads: bool = False  # reads of claims and routes need api_token too


class Core:
    """Agents, controllers, feeds and the HTTP server around a desired state and a store."""

    def __init__(self, settings: CoreSettings, desired: Desired, store: StatusStore, *,
                 clock: Clock | None = None,
                 door: DoorSettings | None = None,
                 standby: Callable[[], str | None] = lambda: None) -> None:
        self.core_settings = settings
        self.clock: Clock = clock or LoopClock()
        self.desired = desired
        self.store = store
        self.registry = CollectorRegistry()
        self.metrics = ClaimMetrics(self.registry, self.store, self.desired, self.clock.wall)
        self._session: aiohttp.ClientSession | None = None
        self._clients: dict[tuple[str, str], HttpAgentClient] = {}
        self.claim_queue: WorkQueue[ClaimKey] = WorkQueue(self.clock)
        self.kv_queue: WorkQueue[str] = WorkQueue(self.clock)
        self.ledger = Ledger()  # requests in flight through the door: the idle check reads them
        tracker = IdleTracker()
        self.cache = SnapshotCache(self._client, self.clock, ttl=settings.snapshot_ttl,
                                   on_snapshot=tracker.observe)
        self.deps = Deps.build(self.clock, self.desired, self.store, self._client,
                               self.cache, tracker=tracker, metrics=self.metrics,
                               timings=settings.timings, kick_kv=self.kv_queue.add,
                               kick_claim=self.claim_queue.add, in_flight=self.ledger.in_flight)
        shared = ControllerMetrics.shared(self.registry)
        self.claims = ClaimReconciler(self.deps)
        self.claim_controller: Controller[ClaimKey] = Controller(
            "modelclaim", self.claims, self.claim_queue, workers=settings.workers,
            clock=self.clock, metrics=shared)
        self.kv_controller: Controller[str] = Controller(
            "kv-division", KvReconciler(self.deps), self.kv_queue,
            workers=settings.kv_workers, clock=self.clock, metrics=shared)
        self._feeds: dict[tuple[str, str], EventFeedSource[ClaimKey]] = {}
        self._connected: set[str] = set()
        self._runner: web.AppRunner | None = None
        self.port = settings.port
        self.door = FrontDoor(door, self.deps, self.registry, self.ledger, standby) \
            if door is not None else None
        if self.door is not None:  # copies by demand weigh the door's queue
            self.deps.reader.queue_wait = self.door.door.queue_wait

    # ---- agents -----------------------------------------------------------------------------

    def _client(self, agent: str) -> AgentApi | None:
        found = self.desired.agent(agent)
        if found is None:
            return None
        ref = found[0]
        key = (ref.name, ref.url)
        client = self._clients.get(key)
        if client is None and self._session is not None:
            client = self._clients[key] = HttpAgentClient(ref.url, self._session)
        return client

    def sync_feeds(self) -> None:
        """One events feed per pool agent (started, or stopped when it left the pools); a new
        agent gets a KV division."""
        assert self._session is not None
        wanted = {(a.name, a.url) for a, _ in self.desired.agents()}
        for key in list(self._feeds.keys() - wanted):
            feed = self._feeds.pop(key)
            self._clients.pop(key, None)
            self._connected.discard(key[0])
            if key[0] not in {n for n, _ in wanted}:
                self.cache.forget(key[0])
            asyncio.get_running_loop().create_task(feed.stop())
        for name, url in sorted(wanted - self._feeds.keys()):
            feed = EventFeedSource(url, self._event_keys_for(name),
                                   on_connect=self._resync_for(name),
                                   wait=self.core_settings.feed_wait, clock=self.clock,
                                   session=self._session)
            self._feeds[(name, url)] = feed
            feed.start(self.claim_queue)
            self.kv_queue.add(name)

    def _event_keys_for(self, agent: str) -> Callable[[Mapping[str, Any]], list[ClaimKey]]:
        return lambda event: self.deps.event_keys(agent, dict(event))

    def _resync_for(self, agent: str) -> Callable[[], None]:
        return lambda: self._resync_agent(agent)

    def _resync_agent(self, agent: str) -> None:
        """The agent's feed (re)connected or missed events: look at its engines again. The
        first connect needs no more than the start's resync; a reconnect looks at the claims
        placed there, the claims its engines answer to, and the claims waiting for room."""
        self.cache.invalidate(agent)
        self.kv_queue.add(agent)
        if agent not in self._connected:
            self._connected.add(agent)
            for key in self.deps.reader.waiting_keys():  # an agent that came up: room appeared
                self.claim_queue.add(key)
            return
        keys = {st.key for st in self.store.values()
                if st.instance is not None and st.instance.agent == agent}
        obs = self.cache.last(agent)
        if obs is not None:
            keys |= set(obs.by_claim)
        keys |= set(self.deps.reader.waiting_keys())
        for key in sorted(keys):
            self.claim_queue.add(key)

    def all_keys(self) -> list[ClaimKey]:
        """Every claim to look at: desired, with a status, or named by an engine."""
        keys = set(self.desired.claims) | self.store.keys()
        for agent, _ in self.desired.agents():
            obs = self.cache.last(agent.name)
            if obs is not None:
                keys |= set(obs.by_claim)
        return sorted(keys)

    # ---- lifecycle --------------------------------------------------------------------------

    async def start_core(self) -> None:
        """Sessions, resync, feeds and controllers (the mode's sources are watched first)."""
        s = self.core_settings  # every call to an agent carries the agents' token, as it is now
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              middlewares=bearer_middleware(s.agent_token))
        self.claim_controller.watch(TimerSource(self.clock, s.resync_interval, self.all_keys,
                                                spread=True))
        self.kv_controller.watch(TimerSource(
            self.clock, s.resync_interval, lambda: [a.name for a, _ in self.desired.agents()],
            spread=True))
        self.desired.on_pools_changed(self.sync_feeds)
        self.sync_feeds()
        self.claim_controller.start()
        self.kv_controller.start()

    async def serve_http(self, extra: Callable[[web.Application], None] | None = None) -> None:
        s = self.core_settings
        app = make_app(self.deps, self.registry, s.api_token, s.auth_reads,
                       (s.agent_token,) if s.agent_token is not s.api_token else ())
        if extra is not None:
            extra(app)
        self._runner, self.port = await serve(app, self.core_settings.host,
                                              self.core_settings.port)

    async def stop_core(self) -> None:
        """Feeds, then controllers (in-flight reconciles get 10 s), then the session."""
        for feed in list(self._feeds.values()):
            await feed.stop()
        self._feeds.clear()
        await self.claim_controller.stop(grace=10.0)
        await self.kv_controller.stop(grace=10.0)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def start_door(self) -> None:
        """Start the door; one that cannot (its port in use, a broken keys file) is stopped
        again, its connections closed, and the error raised."""
        if self.door is not None:
            try:
                await self.door.start()
            except BaseException:
                await self.door.stop()
                raise

    async def stop_door(self) -> None:
        """The door first when stopping: no new requests while the controllers stop."""
        if self.door is not None:
            await self.door.stop()

    async def stop_http(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
