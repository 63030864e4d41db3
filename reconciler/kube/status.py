"""Claim statuses on Kubernetes: the status subresource, optimistic concurrency, finalizers.

``KubeStatusStore`` is the ``StatusStore`` the reconcilers already use (statuses in memory,
changed in place, marked dirty), with a different writer: the flusher sends each dirty status as
a JSON merge patch of the claim's ``/status`` subresource carrying the ``resourceVersion`` last
seen, so the write applies only to the object it was computed for. A ``409 Conflict`` (someone
changed the claim meanwhile) re-reads the claim and writes again (at most ``CONFLICT_RETRIES``
times per round; a claim still in conflict stays dirty for the next round). Conditions carry the
claim's ``observedGeneration``.

Finalizer ``model.aibrix.ai/modelclaim-finalizer``: added when a claim is first reconciled, so a
deletion waits for us; removed when the claim's engine is drained (``drop``), which lets the API
server delete the object. Both are JSON patches that test the list they change.

A status that says Active is written only once the claim's route is published
(``publish_route``): the AIBrix gateway routes by the Pod annotation, so a client that waits for
Active and then sends a request must find the engine on the route. A route that cannot be
published keeps the status unwritten (dirty) for the next round.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from reconciler.desired import ClaimKey, key_text
from reconciler.kube.api import (
    CLAIMS,
    JSON_PATCH,
    MERGE_PATCH,
    Conflict,
    KubeApi,
    KubeError,
    NotFound,
)
from reconciler.kube.desired import KubeDesired
from reconciler.kube.informer import meta
from reconciler.model.manifests import ModelClaim
from reconciler.replicas import base_key, is_replica
from reconciler.status import ACTIVE, ClaimEvent, ClaimStatus
from reconciler.status import _ts as parse_time
from reconciler.store import StatusStore

log = logging.getLogger("reconciler.kube.status")

FINALIZER = "model.aibrix.ai/modelclaim-finalizer"
CONFLICT_RETRIES = 3
WRITERS = 16  # status patches in flight at once


def status_body(st: ClaimStatus) -> dict[str, Any]:
    """The claim's ``status`` as the CRD declares it."""
    doc: dict[str, Any] = dict(st.as_json()["status"])
    if st.observed_generation is not None:
        doc["observedGeneration"] = st.observed_generation
        for cond in doc["conditions"]:
            cond["observedGeneration"] = st.observed_generation
    return doc


class KubeStatusStore(StatusStore):
    def __init__(self, api: KubeApi, desired: KubeDesired, wall: Callable[[], float],
                 on_event: Callable[[ClaimStatus, ClaimEvent], None] | None = None) -> None:
        super().__init__(None, wall)
        self.api = api
        self.desired = desired
        self._on_event = on_event
        self._release: set[ClaimKey] = set()  # finalizers to remove
        self._hold: set[ClaimKey] = set()  # finalizers to add
        self.conflicts = 0
        self.writes = 0
        self.on_mark: Callable[[ClaimKey], None] | None = None  # the route publisher
        # publishes a claim's route now (the route publisher): an Active status is written
        # only after it, so whoever waits for Active finds the engine on the gateway's route
        self.publish_route: Callable[[ClaimKey], Awaitable[None]] | None = None
        # The newest resourceVersion known per claim: from the watch, or from our own last
        # write (which the watch reports later), so our next write does not conflict with us.
        self._versions: dict[ClaimKey, str] = {}

    def note_version(self, key: ClaimKey, version: str) -> None:
        """The watch saw ``version`` of the claim (it is at least as new as our last write)."""
        self._versions[key] = version

    def _version(self, key: ClaimKey) -> str:
        return self._versions.get(key) or str(meta(self.desired.object(key)).get(
            "resourceVersion") or "")

    def _mark(self, key: ClaimKey) -> None:
        super()._mark(key)
        if self.on_mark is not None:
            self.on_mark(key)

    def where(self) -> str:
        return "the Kubernetes API"

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flusher(),
                                                                name="status-writer")

    def _adopt(self, status: ClaimStatus) -> ClaimStatus:
        adopted = super()._adopt(status)
        if self._on_event is not None:
            on_event = self._on_event
            adopted.on_event = lambda event: on_event(adopted, event)
        return adopted

    def ensure(self, claim: ModelClaim) -> ClaimStatus:
        """The claim's status, with the object's uid; its finalizer is added if missing."""
        key = (claim.namespace, claim.name)
        obj = self.desired.object(base_key(key))  # a replica's status: its claim's uid
        m = meta(obj)
        uid = str(m.get("uid") or uuid.uuid4())
        st = self._statuses.get(key)
        if st is not None and st.uid != uid and st.deleted is None:
            self._statuses.pop(key)  # a new object with the same name
        st = super().ensure(claim)
        if st.uid != uid:
            st.uid = uid
            st.notify()
        created = m.get("creationTimestamp")
        if isinstance(created, str):
            stamp = parse_time(created)
            if stamp is not None and stamp != st.created:
                st.created = stamp
        generation = self.desired.generation(key)
        if generation != st.observed_generation:
            st.observed_generation = generation
            st.notify()
        if obj is not None and FINALIZER not in (m.get("finalizers") or ()) \
                and not m.get("deletionTimestamp") and not is_replica(key):
            self._hold.add(key)
            self._wake.set()
        return st

    def drop(self, key: ClaimKey) -> None:
        super().drop(key)
        if self.desired.object(key) is None:
            self._versions.pop(key, None)
        if self.on_mark is not None:
            self.on_mark(key)
        obj = self.desired.object(key)
        if obj is not None and FINALIZER in (meta(obj).get("finalizers") or ()):
            self._release.add(key)
            self._hold.discard(key)
            self._wake.set()

    # ---- writing ----------------------------------------------------------------------------

    async def flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        self._removed.clear()
        hold, self._hold = self._hold, set()
        release, self._release = self._release, set()
        jobs: list[tuple[str, ClaimKey]] = [("finalize", k) for k in sorted(hold)]
        jobs += [("status", k) for k in sorted(dirty)  # a replica's is in its claim's
                 if k in self._statuses and not is_replica(k)]
        jobs += [("release", k) for k in sorted(release)]
        if not jobs:
            return
        gate = asyncio.Semaphore(WRITERS)
        failed: list[tuple[str, ClaimKey]] = []

        async def run(job: tuple[str, ClaimKey]) -> None:
            async with gate:
                try:
                    await self._job(*job)
                except Exception as err:  # kept for the next round
                    log.warning("claim %s: %s failed: %s", key_text(job[1]), job[0], err)
                    failed.append(job)

        firsts = [j for j in jobs if j[0] == "finalize"]
        await asyncio.gather(*(run(job) for job in firsts))  # before the statuses: no races
        await asyncio.gather(*(run(job) for job in jobs if job[0] != "finalize"))
        for kind, key in failed:
            {"finalize": self._hold, "status": self._dirty, "release": self._release}[kind].add(
                key)
        if failed:
            raise RuntimeError(f"{len(failed)} writes to the Kubernetes API failed")

    async def _job(self, kind: str, key: ClaimKey) -> None:
        if kind == "status":
            await self._write_status(key)
        else:
            await self._finalizer(key, add=kind == "finalize")

    async def _write_status(self, key: ClaimKey) -> None:
        st = self._statuses.get(key)
        if st is not None and st.summary()[0] == ACTIVE and self.publish_route is not None:
            await self.publish_route(key)  # raises: the status stays dirty, Active unwritten
        version = self._version(key)
        for attempt in range(CONFLICT_RETRIES + 1):
            st = self._statuses.get(key)
            if st is None:
                return
            body: dict[str, Any] = {"status": status_body(st)}
            if version:
                body["metadata"] = {"resourceVersion": version}
            try:
                written = await self.api.patch(CLAIMS, key[0], key[1], body, MERGE_PATCH,
                                               "status")
                self.writes += 1
                self._versions[key] = str(meta(written).get("resourceVersion") or version)
                return
            except NotFound:
                return  # the claim is gone; its status with it
            except Conflict:
                self.conflicts += 1
                if attempt == CONFLICT_RETRIES:
                    raise
                fresh = await self.api.get(CLAIMS, key[0], key[1])
                version = str(meta(fresh).get("resourceVersion") or "")
                log.info("claim %s: status write conflicted; read version %s and writing "
                         "again", key_text(key), version)

    async def _finalizer(self, key: ClaimKey, add: bool) -> None:
        obj = self.desired.object(key)
        if obj is not None and self._versions.get(key):
            obj = {**obj, "metadata": {**meta(obj), "resourceVersion": self._versions[key]}}
        for attempt in range(CONFLICT_RETRIES + 1):
            if obj is None or attempt > 0:
                try:
                    obj = await self.api.get(CLAIMS, key[0], key[1])
                except NotFound:
                    return
            finalizers = list(meta(obj).get("finalizers") or [])
            if (FINALIZER in finalizers) == add:
                return
            if add and meta(obj).get("deletionTimestamp"):
                return  # a deletion has begun: no new finalizer (the API server refuses it)
            new = finalizers + [FINALIZER] if add else [f for f in finalizers if f != FINALIZER]
            patch = [{"op": "test", "path": "/metadata/resourceVersion",
                      "value": meta(obj).get("resourceVersion")},
                     {"op": "add", "path": "/metadata/finalizers", "value": new}]
            try:
                written = await self.api.patch(CLAIMS, key[0], key[1], patch, JSON_PATCH)
                self._versions[key] = str(meta(written).get("resourceVersion") or "")
                log.info("claim %s: finalizer %s", key_text(key), "added" if add else "removed")
                return
            except (Conflict, KubeError) as err:
                if isinstance(err, NotFound):
                    return
                if attempt == CONFLICT_RETRIES or err.status not in (409, 422):
                    raise
