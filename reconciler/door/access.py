"""The door's access log: one JSON line per request, to stderr or a file.

A line says who asked for what, where it went and how it went::

    {"ts": "2026-11-30T08:42:23.123Z", "logger": "door.access", "method": "POST",
     "path": "/v1/chat/completions", "model": "qwen3-0.6b", "claim": "default/qwen3-0-6b",
     "upstream": "local 127.0.0.1:20001", "status": 200, "stream": true, "duration_ms": 812.4,
     "ttft_ms": 35.1, "held_ms": 402.2, "held_for": "wake", "prompt_tokens": 12,
     "completion_tokens": 16, "bytes": 2431, "error": null, "key": "sha256:1a2b3c4d",
     "client": "10.0.0.7"}

It goes through its own logger (``reconciler.door.access``, not propagated), so it keeps this
shape whatever the agent's log format is; ``--door-access-log off`` turns it off.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOGGER = "reconciler.door.access"


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
    held_ms: float | None = None
    held_for: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    bytes: int = 0
    error: str | None = None
    key: str | None = None


class _Line(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "access", {})
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return json.dumps({"ts": f"{stamp}.{int(record.msecs):03d}Z", "logger": "door.access",
                           **fields})


def access_logger(where: str) -> logging.Logger | None:
    """The access logger writing to ``where`` ("-": stderr, "off": nowhere, else a file)."""
    if where == "off":
        return None
    logger = logging.getLogger(LOGGER)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    for old in list(logger.handlers):
        logger.removeHandler(old)
        old.close()
    out: logging.Handler = logging.StreamHandler(sys.stderr) if where == "-" \
        else logging.FileHandler(Path(where), encoding="utf-8")
    out.setFormatter(_Line())
    logger.addHandler(out)
    return logger


def write(logger: logging.Logger | None, record: AccessRecord) -> None:
    if logger is None:
        return
    fields = dict(vars(record))  # flat: cheaper than dataclasses.asdict's deep copy
    del fields["started"]
    logger.info("access", extra={"access": fields})
