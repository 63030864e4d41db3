"""The local run mode: claims from a manifest directory, statuses in files, agents from a pool.

    claims dir --DirectorySource--+
    pool file  --DirectorySource--+--> claim queue --> the core (``reconciler.core``)

Run modes:

* ``run_reconciler(claims_dir, pool_file, host, port)``: standalone, against the agents the
  pool file names (``runtime-agent reconcile --claims DIR --pool FILE``).
* ``reconciler.local.embedded``: next to one agent in the same process; the local agent is the
  pool (``runtime-agent serve --claims DIR``), and the front door (``reconciler.door``) is on
  by default there.
* ``runtime-agent reconcile --kubernetes``: ``reconciler.kube.app``, the same core against the
  Kubernetes API.

The claims directory is polled every 50 ms (``directory_interval``): a file created, removed or
renamed into place (changing the directory's mtime) reaches the agent within about that much;
a file rewritten in place within a second, or a second per thousand files past a thousand
(``DirectorySource``). Polling
needs no dependency; inotify would make it immediate but is Linux-only and misses changes on
network file systems.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

from contract.clock import Clock, LoopClock
from guard.tokens import TokenSource
from reconciler.context import Timings
from reconciler.core import DEFAULT_PORT, Core, CoreSettings, scaled_timings
from reconciler.door.settings import DoorSettings
from reconciler.footprints import FILE_NAME as FOOTPRINTS_FILE
from reconciler.local.desired import DesiredState
from reconciler.model.manifests import AgentRef
from reconciler.runtime.heap import frozen_heap
from reconciler.runtime.loop import run as run_on_uvloop
from reconciler.runtime.sources import DirectorySource
from reconciler.store import StatusStore

log = logging.getLogger("reconciler.local.app")

__all__ = ["DEFAULT_PORT", "ReconcilerApp", "Settings", "run_reconciler"]


@dataclass(frozen=True)
class Settings:
    claims_dir: Path
    pool_file: Path | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # where statuses are kept; the commands pass a state directory (the agent's, embedded), so
    # the manifest directory (often a checkout) stays as its owner left it
    status_dir: Path | None = None  # None: <claims_dir>/.status
    local_agent: AgentRef | None = None  # embedded mode: this agent is the pool
    directory_interval: float = 0.05
    resync_interval: float = 300.0
    workers: int = 32  # reconciles wait on agents (an activate may wait 2 s for its card)
    kv_workers: int = 2
    snapshot_ttl: float = 0.1
    feed_wait: int = 30
    agent_token: TokenSource | None = field(default=None, repr=False)  # the agents' token
    timings: Timings = field(default_factory=scaled_timings)
    door: DoorSettings | None = None  # the front door (None: off)
    api_token: TokenSource | None = field(default=None, repr=False)  # asked of our callers
    auth_reads: bool = False

    def core(self) -> CoreSettings:
        return CoreSettings(self.host, self.port, self.resync_interval, self.workers,
                            self.kv_workers, self.snapshot_ttl, self.feed_wait,
                            self.agent_token, self.timings, self.api_token, self.auth_reads)


class ReconcilerApp(Core):
    """One reconciler: ``await start()``, then ``await stop()``. ``port``: where it listens."""

    def __init__(self, settings: Settings, *, clock: Clock | None = None) -> None:
        self.settings = settings
        clock = clock or LoopClock()
        status_dir = settings.status_dir or settings.claims_dir / LEGACY_STATUS
        desired = DesiredState(settings.claims_dir, settings.pool_file,
                               local_agent=settings.local_agent,
                               footprints=settings.status_dir.parent / FOOTPRINTS_FILE
                               if settings.status_dir is not None else None)
        super().__init__(settings.core(), desired, StatusStore(status_dir, clock.wall),
                         clock=clock, door=settings.door)
        self.manifests = desired

    async def start(self) -> None:
        if self.settings.status_dir is not None:
            await asyncio.to_thread(move_legacy_statuses, self.settings.claims_dir,
                                    self.settings.status_dir)
        await asyncio.to_thread(self.manifests.load)
        await asyncio.to_thread(self.store.load)
        self.store.start()
        s = self.settings
        self.claim_controller.watch(DirectorySource(s.claims_dir, self.manifests.on_file,
                                                    s.directory_interval, clock=self.clock,
                                                    on_unreadable=self.manifests.on_directory))
        if s.pool_file is not None and s.pool_file.resolve().parent != s.claims_dir.resolve():
            self.claim_controller.watch(DirectorySource(
                s.pool_file.parent, self.manifests.on_pool_file, s.directory_interval,
                clock=self.clock))
        try:
            await self.start_core()
            await self.serve_http()
            await self.start_door()  # a door that cannot start has stopped itself
        except BaseException:  # a port in use: stop what started, close the agents' session
            await self.stop_core()
            await self.stop_http()
            await self.store.stop()
            raise
        log.info("reconciler: %d claims, %d agents, listening on %s:%d",
                 len(self.desired.claims), len(self.desired.agents()), s.host, self.port)

    async def stop(self) -> None:
        """Stop sources, feeds and controllers (in-flight reconciles get 10 s), then the
        server; statuses are flushed to disk. The door stops first: no new requests."""
        await self.stop_door()
        await self.stop_core()
        await self.stop_http()
        await self.store.stop()


LEGACY_STATUS = ".status"  # where statuses were kept before: inside the manifest directory


def move_legacy_statuses(claims_dir: Path, status_dir: Path) -> list[str]:
    """Statuses an older reconciler kept in ``<claims_dir>/.status`` move to ``status_dir``
    (once: only into a directory that has none), so claims keep their history; the files
    moved."""
    legacy = claims_dir / LEGACY_STATUS
    if not legacy.is_dir() or legacy.resolve() == status_dir.resolve():
        return []
    status_dir.mkdir(parents=True, exist_ok=True)
    if any(status_dir.glob("*.json")):
        return []
    moved = []
    for old in sorted(legacy.glob("*.json")):
        old.replace(status_dir / old.name)
        moved.append(old.name)
    with contextlib.suppress(OSError):
        legacy.rmdir()
    if moved:
        log.info("moved %d claim statuses from %s to %s", len(moved), legacy, status_dir)
    return moved


# ---- standalone ---------------------------------------------------------------------------


async def serve_until_signalled(settings: Settings) -> None:
    app = ReconcilerApp(settings)
    await app.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with frozen_heap():
            await stop.wait()
    finally:
        log.info("reconciler: stopping; engines keep running")
        await app.stop()


def run_reconciler(claims_dir: Path | str, pool_file: Path | str | None, host: str = "127.0.0.1",
                   port: int = DEFAULT_PORT, agent_token: TokenSource | None = None,
                   door: DoorSettings | None = None, status_dir: Path | None = None,
                   api_token: TokenSource | None = None, auth_reads: bool = False) -> None:
    """Blocking: reconcile ``claims_dir`` against the agents of ``pool_file`` until SIGTERM."""
    run_on_uvloop(serve_until_signalled(Settings(
        Path(claims_dir), Path(pool_file) if pool_file else None, host, port,
        agent_token=agent_token, door=door, status_dir=status_dir, api_token=api_token,
        auth_reads=auth_reads)))
