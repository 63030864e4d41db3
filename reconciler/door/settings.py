"""The door's settings: where it listens, how long and how many requests it holds, its keys,
and its connection limits (``guard.conns``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from guard.conns import ConnLimits

DEFAULT_DOOR_PORT = 8000  # where OpenAI-compatible servers (vLLM, SGLang's router) listen


@dataclass(frozen=True)
class DoorSettings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_DOOR_PORT  # 0: any free port (tests)
    max_held: int = 256  # per model: requests held for a wake, room or a start
    max_wait_s: float = 120.0  # a held request is answered 503 after this long
    api_keys: Path | None = None  # None: no keys asked for
    access_log: str = "-"  # "-": stderr, "off", or a file
    max_body_bytes: int = 64 << 20
    recheck_s: float = 1.0  # held requests look again at least this often (changes wake them)
    upstream_timeout_s: float = 600.0  # an engine silent this long mid-answer: 504
    allow_release: bool = False  # POST /v1/models/{model}/release (reconciler.door.release)
    # connections: at most this many (and a quarter of the fd soft limit), per client address
    # at most ``max_connections_per_client`` (0: half the cap); a request head must be whole
    # within ``head_timeout_s``, a body within ``body_timeout_s`` of its head
    max_connections: int = 4096
    max_connections_per_client: int = 0
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    def limits(self) -> ConnLimits:
        return ConnLimits(self.max_connections, self.max_connections_per_client,
                          self.head_timeout_s, self.body_timeout_s, fd_fraction=4)
