"""vLLM-like (and, in Ollama mode, Ollama-like) log lines for the simulated engine.

Supervisors and humans read engine logs: vLLM's own logger writes ``INFO 05-12 10:00:00 [file.py:12]
message`` to stdout, and uvicorn writes ``INFO:     Started server process [123]`` to stderr. The
simulator prints the same shapes, flushed at once, so log scraping and crash diagnosis behave the
same with the simulated engine as with the real one.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _emit(stream: TextIO, line: str) -> None:
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):  # closed pipe or stream: logging must never kill the engine
        pass


def engine_log(level: str, message: str, source: str = "sim_engine.py") -> None:
    """A line from vLLM's logger (stdout)."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    _emit(sys.stdout, f"{level} {stamp} [{source}] {message}")


def server_log(level: str, message: str) -> None:
    """A line from the HTTP server, shaped like uvicorn's default formatter (stderr)."""
    _emit(sys.stderr, f"{level + ':':<9} {message}")


def access_log(peer: str, method: str, path: str, status: int, reason: str) -> None:
    """A uvicorn access-log line (stdout)."""
    _emit(sys.stdout, f'INFO:     {peer} - "{method} {path} HTTP/1.1" {status} {reason}')


def ollama_log(level: str, message: str, source: str = "routes.go:1") -> None:
    """A line from Ollama's slog text handler (stderr): ``time=... level=INFO source=... msg="..."``."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S") + time.strftime("%z")[:3] + ":" + time.strftime("%z")[3:]
    escaped = message.replace("\\", "\\\\").replace('"', '\\"')
    _emit(sys.stderr, f'time={stamp} level={level} source={source} msg="{escaped}"')


def gin_log(status: int, seconds: float, peer: str, method: str, path: str) -> None:
    """A gin access-log line (stdout), as ``ollama serve`` prints for every request."""
    stamp = time.strftime("%Y/%m/%d - %H:%M:%S")
    _emit(sys.stdout, f'[GIN] {stamp} | {status:3d} | {seconds * 1000:10.3f}ms | {peer:>15} | {method:<7} "{path}"')
