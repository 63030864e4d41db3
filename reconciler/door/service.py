"""The door running beside the reconciler: its HTTP server, its connections to the engines and
the API keys file it re-reads.

``FrontDoor`` is built by the reconciler's core (``reconciler.core``, in both run modes) with its
own ``Deps``: the same status store, route holds, wake book, snapshot cache and idle tracker the
controllers use, so the door and the reconciler can never disagree about where a model serves.
Every status change and every route hold bumps the door's ``Changes``, which wakes held requests.
``standby`` says why the replica cannot serve (a Kubernetes standby): every request is then
answered 503 ``not_leading`` (``reconciler.door.server``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from reconciler.context import Deps
from reconciler.door.access import AccessLog
from reconciler.door.door import Door
from reconciler.door.keys import KeyFile
from reconciler.door.ledger import Changes, Ledger
from reconciler.door.metrics import DoorMetrics
from reconciler.door.http1 import Server
from reconciler.door.server import make_server
from reconciler.door.settings import DoorSettings

log = logging.getLogger("reconciler.door")

KEYS_CHECK_S = 2.0
SHUTDOWN_S = 2.0  # streams still open at shutdown get this long


class FrontDoor:
    """``await start()``, then ``await stop()``; ``port``: where it listens."""

    def __init__(self, settings: DoorSettings, deps: Deps, registry: CollectorRegistry,
                 ledger: Ledger, standby: Callable[[], str | None] = lambda: None) -> None:
        self.settings = settings
        self.changes = Changes()
        self.ledger = ledger
        self.metrics = DoorMetrics(registry, ledger)
        self.door = Door(settings, deps, self.metrics, ledger, self.changes, standby)
        self.keys = KeyFile(settings.api_keys)
        self.access = AccessLog(settings.access_log)
        deps.reader.store.listen(self.changes.bump)
        deps.books.holds.listen(self.changes.bump)
        self.port = settings.port
        self._server: Server | None = None
        self._keys_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        s = self.settings
        await asyncio.to_thread(self.keys.load)  # a broken keys file stops the start
        await asyncio.to_thread(self.access.open)
        self._server = make_server(self.door, self.keys, self.access, SHUTDOWN_S)
        self.port = await self._server.start(s.host, s.port)
        if self.keys.enabled:
            self._keys_task = asyncio.get_running_loop().create_task(self._watch_keys())
        log.info("door: OpenAI-compatible endpoint on %s:%d (%s)", s.host, self.port,
                 "API keys from " + str(s.api_keys) if s.api_keys else "no API keys")

    async def _watch_keys(self) -> None:
        while True:
            await asyncio.sleep(KEYS_CHECK_S)
            await asyncio.to_thread(self.keys.check)

    async def stop(self) -> None:
        if self._keys_task is not None:
            self._keys_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keys_task
        if self._server is not None:
            await self._server.stop()
        self.access.close()
        await self.door.catalog.stop()
        self.door.upstream.close()
