"""Wiring: manifests, stores, clients, the two controllers, their sources and the HTTP server.

    claims dir --DirectorySource--+                    +--> ClaimReconciler (8 workers)
    pool file  --DirectorySource--+--> claim queue ----+        | activate, sleep, wake, stop
    resync     --TimerSource------+        ^                    v
    agents' events --EventFeedSource-------+            agents (HttpAgentClient)
                              \\--> KV queue ----------> KvReconciler (per agent) --kv-limit-->

Run modes:

* ``run_reconciler(claims_dir, pool_file, host, port)``: standalone, against the agents the
  pool file names (``runtime-agent reconcile --claims DIR --pool FILE``).
* ``start_embedded(agent_url, claims_dir, listen_host, listen_port, door)``: next to one agent
  in the same process; the local agent is the pool (``runtime-agent serve --claims DIR``), and
  the front door (``reconciler.door``) is on by default there.

The claims directory is polled every 50 ms (``directory_interval``): a change reaches the
agent within about that much. Polling costs one ``scandir`` and a ``stat`` per manifest per
poll (well under a millisecond for a hundred files) and needs no dependency; inotify would make
it immediate but is Linux-only and misses changes on network file systems.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from reconciler.claims import ClaimReconciler
from reconciler.client import AgentApi, HttpAgentClient
from reconciler.context import Deps, Timings
from reconciler.desired import ClaimKey, DesiredState
from reconciler.door.ledger import Ledger
from reconciler.door.service import FrontDoor
from reconciler.door.settings import DoorSettings
from reconciler.kv import KvReconciler
from reconciler.metrics import ClaimMetrics
from reconciler.model.manifests import AgentRef
from reconciler.observe import IdleTracker, SnapshotCache
from reconciler.runtime.clock import Clock, RealClock
from reconciler.runtime.controller import Controller
from reconciler.runtime.metrics import ControllerMetrics
from reconciler.runtime.queue import WorkQueue
from reconciler.runtime.sources import DirectorySource, EventFeedSource, TimerSource
from reconciler.server import make_app, serve
from reconciler.store import StatusStore

log = logging.getLogger("reconciler.app")

DEFAULT_PORT = 8081


@dataclass(frozen=True)
class Settings:
    claims_dir: Path
    pool_file: Path | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    status_dir: Path | None = None  # default: <claims_dir>/.status
    local_agent: AgentRef | None = None  # embedded mode: this agent is the pool
    directory_interval: float = 0.05
    resync_interval: float = 30.0
    workers: int = 32  # reconciles wait on agents (an activate may wait 2 s for its card)
    kv_workers: int = 2
    snapshot_ttl: float = 0.1
    feed_wait: int = 30
    timings: Timings = field(default_factory=Timings)
    agent_token: str | None = field(default=None, repr=False)  # the agents' bearer token
    door: DoorSettings | None = None  # the front door (None: off)


class ReconcilerApp:
    """One reconciler: ``await start()``, then ``await stop()``. ``port``: where it listens."""

    def __init__(self, settings: Settings, *, clock: Clock | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.clock: Clock = clock or RealClock()
        status_dir = settings.status_dir or settings.claims_dir / ".status"
        self.desired = DesiredState(settings.claims_dir, settings.pool_file,
                                    local_agent=settings.local_agent)
        self.store = StatusStore(status_dir, wall)
        self.registry = CollectorRegistry()
        self.metrics = ClaimMetrics(self.registry, self.store, self.desired, wall)
        self._session: aiohttp.ClientSession | None = None
        self._clients: dict[tuple[str, str], HttpAgentClient] = {}
        self.claim_queue: WorkQueue[ClaimKey] = WorkQueue(self.clock)
        self.kv_queue: WorkQueue[str] = WorkQueue(self.clock)
        tracker = IdleTracker()
        cache = SnapshotCache(self._client, self.clock, ttl=settings.snapshot_ttl,
                              on_snapshot=tracker.observe)
        ledger = Ledger()  # the door's requests in flight: the idle check reads them
        self.deps = Deps(self.clock, wall, self.desired, self.store, self._client, cache,
                         tracker=tracker, metrics=self.metrics, timings=settings.timings,
                         kick_kv=self.kv_queue.add, kick_claim=self.claim_queue.add,
                         in_flight=ledger.in_flight)
        self.door = FrontDoor(settings.door, self.deps, self.registry, ledger) \
            if settings.door is not None else None
        shared = ControllerMetrics.shared(self.registry)
        self.claims = ClaimReconciler(self.deps)
        self.claim_controller: Controller[ClaimKey] = Controller(
            "modelclaim", self.claims, self.claim_queue, workers=settings.workers,
            clock=self.clock, metrics=shared)
        self.kv_controller: Controller[str] = Controller(
            "kv-division", KvReconciler(self.deps), self.kv_queue,
            workers=settings.kv_workers, clock=self.clock, metrics=shared)
        self._feeds: dict[tuple[str, str], EventFeedSource[ClaimKey]] = {}
        self._runner: web.AppRunner | None = None
        self.port = settings.port

    # ---- agents -----------------------------------------------------------------------------

    def _client(self, agent: str) -> AgentApi | None:
        for ref, _ in self.desired.agents():
            if ref.name == agent:
                key = (ref.name, ref.url)
                client = self._clients.get(key)
                if client is None and self._session is not None:
                    client = self._clients[key] = HttpAgentClient(ref.url, self._session)
                return client
        return None

    def _sync_feeds(self) -> None:
        """One events feed per pool agent (started, or stopped when it left the pools)."""
        assert self._session is not None
        wanted = {(a.name, a.url) for a, _ in self.desired.agents()}
        for key in list(self._feeds.keys() - wanted):
            feed = self._feeds.pop(key)
            asyncio.get_running_loop().create_task(feed.stop())
        for name, url in sorted(wanted - self._feeds.keys()):
            feed = EventFeedSource(url, self._event_keys_for(name),
                                   on_connect=self._resync_for(name),
                                   wait=self.settings.feed_wait, clock=self.clock,
                                   session=self._session)
            self._feeds[(name, url)] = feed
            feed.start(self.claim_queue)
        for name, _ in wanted:
            self.kv_queue.add(name)

    def _event_keys_for(self, agent: str) -> Callable[[Mapping[str, Any]], list[ClaimKey]]:
        return lambda event: self.deps.event_keys(agent, dict(event))

    def _resync_for(self, agent: str) -> Callable[[], None]:
        return lambda: self._resync_agent(agent)

    def _resync_agent(self, agent: str) -> None:
        self.deps.cache.invalidate(agent)
        self.kv_queue.add(agent)
        for key in self._all_keys():
            self.claim_queue.add(key)

    def _all_keys(self) -> list[ClaimKey]:
        """Every claim to look at: in the manifests, with a status, or named by an engine."""
        keys = set(self.desired.claims) | self.store.keys()
        for agent, _ in self.desired.agents():
            obs = self.deps.cache.last(agent.name)
            if obs is not None:
                keys |= {e.claim_ref for e in obs.engines if e.claim_ref is not None}
        return sorted(keys)

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self.desired.load)
        await asyncio.to_thread(self.store.load)
        token = self.settings.agent_token  # every call to an agent carries it, feeds too
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            headers={"Authorization": f"Bearer {token}"} if token else None)
        self.store.start()
        s = self.settings
        self.claim_controller.watch(DirectorySource(s.claims_dir, self.desired.on_file,
                                                    s.directory_interval, clock=self.clock))
        if s.pool_file is not None and s.pool_file.resolve().parent != s.claims_dir.resolve():
            self.claim_controller.watch(DirectorySource(
                s.pool_file.parent, self.desired.on_pool_file, s.directory_interval,
                clock=self.clock))
        self.claim_controller.watch(TimerSource(self.clock, s.resync_interval, self._all_keys))
        self.kv_controller.watch(TimerSource(
            self.clock, s.resync_interval, lambda: [a.name for a, _ in self.desired.agents()]))
        self.desired.on_pools_changed(self._sync_feeds)
        self._sync_feeds()
        self.claim_controller.start()
        self.kv_controller.start()
        self._runner, self.port = await serve(make_app(self.deps, self.registry), s.host,
                                              s.port)
        if self.door is not None:
            await self.door.start()
        log.info("reconciler: %d claims, %d agents, listening on %s:%d",
                 len(self.desired.claims), len(self.desired.agents()), s.host, self.port)

    async def stop(self) -> None:
        """Stop sources, feeds and controllers (in-flight reconciles get 10 s), then the
        server; statuses are flushed to disk. The door stops first: no new requests."""
        if self.door is not None:
            await self.door.stop()
        for feed in list(self._feeds.values()):
            await feed.stop()
        self._feeds.clear()
        await self.claim_controller.stop(grace=10.0)
        await self.kv_controller.stop(grace=10.0)
        if self._runner is not None:
            await self._runner.cleanup()
        await self.store.stop()
        if self._session is not None:
            await self._session.close()


# ---- run modes ----------------------------------------------------------------------------


def local_agent(agent_url: str, name: str | None = None) -> AgentRef:
    return AgentRef(name or socket.gethostname(), agent_url.rstrip("/"))


async def start_embedded(agent_url: str, claims_dir: Path | str, listen_host: str = "127.0.0.1",
                         listen_port: int = DEFAULT_PORT,
                         agent_token: str | None = None,
                         door: DoorSettings | None = None) -> ReconcilerApp:
    """Start a reconciler whose pool is the one agent at ``agent_url`` (and its front door,
    with ``door``); ``await handle.stop()`` stops it. The agent may still be starting: the
    reconciler waits for it."""
    app = ReconcilerApp(Settings(Path(claims_dir), host=listen_host, port=listen_port,
                                 local_agent=local_agent(agent_url), agent_token=agent_token,
                                 door=door))
    await app.start()
    return app


async def serve_until_signalled(settings: Settings) -> None:
    app = ReconcilerApp(settings)
    await app.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("reconciler: stopping; engines keep running")
        await app.stop()


def run_reconciler(claims_dir: Path | str, pool_file: Path | str | None, host: str = "0.0.0.0",
                   port: int = DEFAULT_PORT, agent_token: str | None = None,
                   door: DoorSettings | None = None) -> None:
    """Blocking: reconcile ``claims_dir`` against the agents of ``pool_file`` until SIGTERM."""
    asyncio.run(serve_until_signalled(Settings(
        Path(claims_dir), Path(pool_file) if pool_file else None, host, port,
        agent_token=agent_token, door=door)))

