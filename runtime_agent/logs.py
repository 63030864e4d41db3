"""Agent logging: JSON lines by default (one object per line, model name on engine lines)."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        item: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        model = getattr(record, "model", None)
        if model is not None:
            item["model"] = model
        event = getattr(record, "event", None)
        if isinstance(event, dict):
            item["event"] = event
        if record.exc_info:
            item["exc"] = self.formatException(record.exc_info)
        return json.dumps(item)


def setup_logging(fmt: str = "json", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The weight cache's HTTP libraries log every request at INFO; its own events say enough.
    for noisy in ("httpx", "httpx2", "huggingface_hub", "botocore", "boto3", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
