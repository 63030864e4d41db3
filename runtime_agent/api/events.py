"""The events feed: every engine transition as a structured log line and in a bounded ring.

Readers ask for the events after a cursor (a sequence number), so a client that reconnects with
its last cursor misses nothing still in the ring, and ``wait_after`` wakes followers the moment
something happens: no polling. Sequence numbers start again at 1 when the agent restarts, so
every event and answer carries the agent's ``boot_id``: a follower whose cursor is from another
boot is told to re-list instead of silently skipping the new boot's first events.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

from runtime_agent.loops import wait_event
from runtime_agent.supervision.views import EngineEvent

if TYPE_CHECKING:  # the weight cache's modules load with the cache, not at start
    from runtime_agent.artifacts.entries import ArtifactEvent

log = logging.getLogger("runtime_agent.api.events")


class EventLog:
    def __init__(self, capacity: int = 4096, boot_id: str | None = None) -> None:
        self.boot_id = boot_id or uuid.uuid4().hex[:16]
        self._ring: deque[tuple[int, dict[str, Any]]] = deque(maxlen=capacity)
        self._seq = 0
        self._changed = asyncio.Event()
        self.closed = False  # the agent is stopping: long polls answer now, streams end

    @property
    def last_seq(self) -> int:
        return self._seq

    def append(self, event: EngineEvent | ArtifactEvent) -> None:
        """An engine's event, or a weight-cache entry's (``kind: artifact``, ``model`` empty)."""
        self._seq += 1
        item = {"seq": self._seq, "boot_id": self.boot_id, **event.as_dict()}
        self._ring.append((self._seq, item))
        first = event.message.splitlines()[0] if event.message else ""
        if isinstance(event, EngineEvent):
            log.info("%s: %s -> %s (%s) %s", event.model_name, event.src, event.dst,
                     event.reason, first, extra={"model": event.model_name, "event": item})
        else:
            log.info("artifact %s: %s -> %s (%s) %s", event.artifact_url, event.src, event.dst,
                     event.reason, first, extra={"event": item})
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def first_seq(self) -> int:
        """The oldest sequence number still in the ring (last_seq + 1 when it is empty)."""
        return self._ring[0][0] if self._ring else self._seq + 1

    def since(self, cursor: int, limit: int = 1000) -> list[dict[str, Any]]:
        return [item for seq, item in self._ring if seq > cursor][:limit]

    async def wait_after(self, cursor: int, timeout_s: float) -> None:
        """Return once an event newer than ``cursor`` exists, after ``timeout_s``, or at once
        when the feed is closed."""
        if self._seq > cursor or self.closed:
            return
        await wait_event(self._changed, timeout_s)

    def close(self) -> None:
        """The agent stops: every long poll answers with what it has and every stream ends
        now, so closing the API does not wait out its followers' timeouts (a reconciler's
        long poll holds its connection up to a minute)."""
        self.closed = True
        self._changed.set()
