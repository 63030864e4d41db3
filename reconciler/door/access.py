"""The door's access log: one JSON line per request, to stderr or a file.

A line says who asked for what, where it went and how it went (``duration_ms`` less
``held_ms`` and ``upstream_ms``, the engine's part, is the door's own)::

    {"ts": "2026-11-30T08:42:23.123Z", "logger": "door.access", "method": "POST",
     "path": "/v1/chat/completions", "client": "10.0.0.7", "model": "qwen3-0.6b",
     "claim": "default/qwen3-0-6b", "upstream": "local 127.0.0.1:20001", "status": 200,
     "stream": true, "duration_ms": 812.4, "ttft_ms": 35.1, "upstream_ms": 409.6,
     "held_ms": 402.2,
     "held_for": "wake", "prompt_tokens": 12, "completion_tokens": 16, "bytes": 2431,
     "error": null, "key": "sha256:1a2b3c4d", "route": null, "route_choice": null,
     "route_rechosen_from": null, "route_slept": null}

Lines are written in batches, at most ``FLUSH_S`` after the request ended (one write for many
requests: the logging module's lock, record and flush per line cost the door more than a fifth
of its time per request), and at shutdown. They keep this shape whatever the agent's log format
is; ``--door-access-log off`` turns them off.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import IO

FLUSH_S = 0.2
MAX_PENDING = 1000  # lines; more are written at once


@dataclass
class AccessRecord:
    method: str
    path: str
    client: str
    started: float  # monotonic
    model: str | None = None
    claim: str | None = None
    upstream: str | None = None
    status: int = 0
    stream: bool = False
    duration_ms: float = 0.0
    ttft_ms: float | None = None
    upstream_ms: float | None = None  # sent to the engine -> its last byte passed on
    held_ms: float | None = None
    held_for: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    bytes: int = 0
    error: str | None = None
    key: str | None = None
    route: str | None = None  # the ModelRoute asked for (``model`` is the claim's that served)
    route_choice: str | None = None  # warm, converged, woken, started, queued, made-room, held
    route_rechosen_from: str | None = None  # a held call's first choice, when another served
    route_slept: str | None = None  # made-room: the models the door chose to sleep for it


class AccessLog:
    """Access lines to ``where`` ("-": stderr, "off": nowhere, else a file, appended)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._out: IO[str] | None = None
        self._pending: list[str] = []
        self._timer: asyncio.TimerHandle | None = None

    def open(self) -> None:
        """Blocking (a file is opened): call once at start."""
        if self.where == "-":
            self._out = sys.stderr
        elif self.where != "off":
            self._out = open(self.where, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)

    def write(self, record: AccessRecord) -> None:
        if self._out is None:
            return
        now = time.time()
        fields = dict(vars(record))  # flat: cheaper than dataclasses.asdict's deep copy
        del fields["started"]
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
        self._pending.append(json.dumps({"ts": f"{stamp}.{int(now * 1000) % 1000:03d}Z",
                                         "logger": "door.access", **fields}))
        if len(self._pending) >= MAX_PENDING:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._out is None or not self._pending:
            return
        lines, self._pending = self._pending, []
        try:
            self._out.write("\n".join(lines) + "\n")
            self._out.flush()
        except OSError:
            pass  # a full disk must not take the door down; the lines are lost

    def close(self) -> None:
        self.flush()
        if self._out is not None and self._out is not sys.stderr:
            self._out.close()
        self._out = None
