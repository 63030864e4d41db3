"""The status store: every claim's status in memory, and on disk as JSON.

Every change to a ``ClaimStatus`` marks its claim dirty; one flusher task writes dirty statuses
atomically (temporary file, fsync, rename, directory fsync) to
``<status_dir>/<namespace>_<name>.json`` (``<state-dir>/claims-status`` from the command
line), coalescing bursts of changes into one write,
and never two writes at once. A restarted reconciler reads them back, so it knows where its
claims were placed, their uids, and since when they wait; an unreadable file is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from guard.files import write_atomically
from reconciler.desired import ClaimKey
from reconciler.model.manifests import ModelClaim
from reconciler.replicas import base_key, index_of, is_replica
from reconciler.status import ClaimStatus

log = logging.getLogger("reconciler.store")


class StatusStore:
    """Every claim's status, in memory and (with ``directory``) on disk."""

    def __init__(self, directory: Path | None, wall: Callable[[], float]) -> None:
        self.directory = directory
        self._wall = wall
        self._statuses: dict[ClaimKey, ClaimStatus] = {}
        self._dirty: set[ClaimKey] = set()
        self._removed: set[ClaimKey] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failing = False  # the last write failed: its outage is logged once
        self._listeners: list[Callable[[], None]] = []
        self._replicas: dict[ClaimKey, set[ClaimKey]] = {}  # a claim's replicas 1..

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the loop, synchronously) after every change of any status."""
        self._listeners.append(listener)

    def where(self) -> str:
        return str(self.directory)

    def _path(self, key: ClaimKey) -> Path:
        assert self.directory is not None
        return self.directory / f"{key[0]}_{key[1]}.json"

    def load(self) -> None:
        """Blocking: read the statuses a previous run left (unreadable files are skipped)."""
        if self.directory is None or not self.directory.is_dir():
            return
        for path in sorted(self.directory.glob("*.json")):
            try:
                status = ClaimStatus.from_json(json.loads(path.read_text("utf-8")))
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("status file %s is unreadable (%s); ignoring it", path, err)
                continue
            self._adopt(status)

    def _adopt(self, status: ClaimStatus) -> ClaimStatus:
        key = status.key
        status.notify = lambda: self._mark(key)
        self._statuses[key] = status
        if is_replica(key):
            self._replicas.setdefault(base_key(key), set()).add(key)
        else:
            status.replicas = lambda: self.replicas_of(key)
        return status

    def replicas_of(self, key: ClaimKey) -> list[ClaimStatus]:
        """The statuses of the claim's replicas 1.. (``reconciler.replicas``), by index."""
        keys = self._replicas.get(key)
        if not keys:
            return []
        return [self._statuses[k] for k in sorted(keys, key=index_of) if k in self._statuses]

    def replica_keys(self, key: ClaimKey) -> list[ClaimKey]:
        return sorted(self._replicas.get(key, ()), key=index_of)

    def _mark(self, key: ClaimKey) -> None:
        self._dirty.add(key)
        self._removed.discard(key)
        if is_replica(key) and base_key(key) in self._statuses:
            self._dirty.add(base_key(key))  # its status lists the replica's instance
        self._wake.set()
        for listener in self._listeners:
            listener()

    def get(self, key: ClaimKey) -> ClaimStatus | None:
        return self._statuses.get(key)

    def by_model(self, model_name: str) -> ClaimKey | None:
        """The claim whose status names ``model_name`` (a claim gone from the manifests)."""
        return next((k for k, st in self._statuses.items() if st.model_name == model_name), None)

    def ensure(self, claim: ModelClaim) -> ClaimStatus:
        """The claim's status, created (with a new uid) the first time the claim is seen."""
        key = (claim.namespace, claim.name)
        status = self._statuses.get(key)
        if status is None or status.deleted is not None:
            status = self._adopt(ClaimStatus(claim.namespace, claim.name, str(uuid.uuid4()),
                                             self._wall()))
            status.not_ready_since = status.created
            self._mark(key)
        status.set_spec(claim)
        return status

    def drop(self, key: ClaimKey) -> None:
        if is_replica(key):
            held = self._replicas.get(base_key(key))
            if held is not None:
                held.discard(key)
                if not held:
                    del self._replicas[base_key(key)]
                if base_key(key) in self._statuses:
                    self._mark(base_key(key))
        if self._statuses.pop(key, None) is not None:
            self._dirty.discard(key)
            self._removed.add(key)
            self._wake.set()
            for listener in self._listeners:
                listener()

    def all(self) -> Iterator[ClaimStatus]:
        return iter(sorted(self._statuses.values(), key=lambda s: s.key))

    def claims(self) -> Iterator[ClaimStatus]:
        """Every claim's status, sorted, without its replicas' (their instances are in it)."""
        return (st for st in self.all() if not is_replica(st.key))

    def values(self) -> Iterator[ClaimStatus]:
        """Every status, in no order (``all`` sorts, for people)."""
        return iter(list(self._statuses.values()))

    def keys(self) -> set[ClaimKey]:
        return set(self._statuses)

    # ---- writing ----------------------------------------------------------------------------

    def start(self) -> None:
        if self.directory is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flusher(),
                                                                name="status-flusher")

    async def stop(self) -> None:
        """Let the flusher finish its write (never two at once), then write what is left."""
        if self._task is not None:
            self._stopping = True
            self._wake.set()
            await asyncio.wait([self._task])
            self._task = None
        await self.flush()

    async def flush(self) -> None:
        """Write every dirty status now (and remove dropped ones)."""
        if self.directory is None:
            self._dirty.clear()
            self._removed.clear()
            return
        dirty, self._dirty = self._dirty, set()
        removed, self._removed = self._removed, set()
        docs = {k: json.dumps(self._statuses[k].as_json(), indent=1).encode()
                for k in dirty if k in self._statuses}
        if docs or removed:
            try:
                await asyncio.to_thread(self._write, docs, removed)
            except BaseException:
                self._dirty |= dirty - removed
                self._removed |= removed
                raise

    def _write(self, docs: dict[ClaimKey, bytes], removed: set[ClaimKey]) -> None:
        assert self.directory is not None
        # Not parents=True: a vanished claims directory is not recreated (empty) by us, which
        # the next poll would read as "every claim deleted".
        self.directory.mkdir(exist_ok=True)
        for key, data in docs.items():
            write_atomically(self._path(key), data)
        for key in removed:
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()

    async def _flusher(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            try:
                await self.flush()
            except Exception as err:
                # One line an outage, not a traceback a second (a full disk, or descriptors
                # run out: EMFILE); a bug that is no OSError keeps its traceback, once.
                if not self._failing:
                    if isinstance(err, OSError):
                        log.error("writing claim statuses to %s failed (%s); retrying every "
                                  "second", self.where(), err)
                    else:
                        log.exception("writing claim statuses to %s failed; retrying every "
                                      "second", self.where())
                self._failing = True
                await asyncio.sleep(1.0)
                self._wake.set()
            else:
                if self._failing:
                    log.info("claim statuses are written to %s again", self.where())
                self._failing = False
            await asyncio.sleep(0.05)  # coalesce bursts of changes into one write each
