"""Kubernetes Events for claims and pools, rate-limited and aggregated like client-go's recorder.

client-go's ``EventCorrelator`` does three things before an Event reaches the API server, and so
does ``EventRecorder``:

* **Spam filter**: a token bucket per involved object, 25 Events in a burst and then one every
  five minutes (the guide: "sends at most 25 Events for a claim in a burst, and then one every
  five minutes"). An Event without a token is dropped (and counted).
* **Aggregation**: more than 10 Events of one object, type and reason with different messages
  within 10 minutes become one Event whose message starts ``(combined from similar events):``.
* **Deduplication**: an Event equal to one sent within 10 minutes (same object, type, reason and
  message) is not created again: the existing one's ``count`` and ``lastTimestamp`` are patched.

Writes run on a few background tasks, off the reconcile path (a patch of a repeated Event
may overtake its create: it then fails, and the Event keeps its first count); a failed write is logged and dropped
(Events are best effort, as in client-go).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from contract.clock import Clock, LoopClock
from reconciler.kube.api import EVENTS, MERGE_PATCH, KubeApi, KubeError

log = logging.getLogger("reconciler.kube.events")

COMPONENT = "modelclaim-controller"
BURST = 25
REFILL_S = 300.0
WINDOW_S = 600.0
MAX_SIMILAR = 10
COMBINED = "(combined from similar events): "


def stamp(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str = ""

    def as_json(self) -> dict[str, str]:
        doc = {"apiVersion": self.api_version, "kind": self.kind, "namespace": self.namespace,
               "name": self.name}
        if self.uid:
            doc["uid"] = self.uid
        return doc


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class _Sent:
    name: str
    count: int
    first: float
    last: float
    at: float  # clock time of the last send


@dataclass
class _Similar:
    messages: set[str] = field(default_factory=set)
    since: float = 0.0


class EventRecorder:
    def __init__(self, api: KubeApi, *, clock: Clock | None = None, component: str = COMPONENT,
                 burst: int = BURST, refill_s: float = REFILL_S) -> None:
        self.api = api
        self.clock: Clock = clock or LoopClock()
        self.component = component
        self.burst = burst
        self.refill_s = refill_s
        self._buckets: dict[ObjectRef, _Bucket] = {}
        self._sent: dict[tuple[ObjectRef, str, str, str], _Sent] = {}
        self._similar: dict[tuple[ObjectRef, str, str], _Similar] = {}
        self._queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.dropped = 0
        self.created = 0
        self.patched = 0

    # ---- deciding ---------------------------------------------------------------------------

    def _allow(self, ref: ObjectRef, now: float) -> bool:
        bucket = self._buckets.get(ref)
        if bucket is None:
            bucket = self._buckets[ref] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) / self.refill_s)
        bucket.at = now
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    def record(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None:
        """Queue an Event (``type_``: Normal or Warning), or drop it by the rules above."""
        now, wall = self.clock.now(), self.clock.wall()
        if not self._allow(ref, now):
            self.dropped += 1
            return
        similar = self._similar.get((ref, type_, reason))
        if similar is None or now - similar.since > WINDOW_S:
            similar = self._similar[(ref, type_, reason)] = _Similar(since=now)
        similar.messages.add(message)
        if len(similar.messages) > MAX_SIMILAR:
            message = COMBINED + message
        key = (ref, type_, reason, message if not message.startswith(COMBINED) else COMBINED)
        sent = self._sent.get(key)
        if sent is not None and now - sent.at <= WINDOW_S:
            sent.count += 1
            sent.last, sent.at = wall, now
            self._sent[key] = self._sent.pop(key)  # newest last: the oldest go first
            self._queue.put_nowait(("patch", {"namespace": ref.namespace, "name": sent.name,
                                              "count": sent.count, "last": stamp(wall),
                                              "message": message}))
            return
        name = f"{ref.name}.{uuid.uuid4().hex[:16]}"
        self._sent.pop(key, None)  # an expired one goes: the new one is the newest, last
        self._sent[key] = _Sent(name, 1, wall, wall, now)
        self._queue.put_nowait(("create", {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": ref.namespace},
            "involvedObject": ref.as_json(), "reason": reason, "message": message[:1024],
            "type": type_, "count": 1, "firstTimestamp": stamp(wall),
            "lastTimestamp": stamp(wall), "source": {"component": self.component},
            "reportingComponent": self.component}))
        self._forget_old(now)

    def _forget_old(self, now: float) -> None:
        """Drop Events sent longer than the window ago. ``_sent`` is kept in the order of the
        last send, so only the expired ones at its front are read (a scan of every entry on
        each Event cost most of the CPU of a 10,000-claim fleet's writes)."""
        while self._sent:
            key = next(iter(self._sent))
            if now - self._sent[key].at <= WINDOW_S:
                return
            del self._sent[key]

    # ---- writing ----------------------------------------------------------------------------

    def start(self, writers: int = 8) -> None:
        """``writers`` tasks send the queue (a burst of a fleet's Events is thousands)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._writer(), name=f"event-recorder-{i}")
                       for i in range(writers)]

    async def stop(self, grace: float = 2.0) -> None:
        """Send what is queued (for up to ``grace`` seconds), then stop."""
        if not self._tasks:
            return
        try:
            await asyncio.wait_for(self._queue.join(), grace)
        except TimeoutError:
            pass
        for task in self._tasks:
            task.cancel()
        await asyncio.wait(self._tasks)
        self._tasks = []

    async def _writer(self) -> None:
        while True:
            kind, doc = await self._queue.get()
            try:
                if kind == "create":
                    await self.api.create(EVENTS, doc["metadata"]["namespace"], doc)
                    self.created += 1
                else:
                    await self.api.patch(EVENTS, doc["namespace"], doc["name"],
                                         {"count": doc["count"], "lastTimestamp": doc["last"],
                                          "message": doc["message"][:1024]}, MERGE_PATCH)
                    self.patched += 1
            except (KubeError, OSError, asyncio.TimeoutError) as err:
                log.warning("event %s failed: %s", kind, err)
            except Exception:
                log.exception("event %s failed", kind)
            finally:
                self._queue.task_done()
