"""What the door's HTTP server (``http1``) hands its handlers and takes back: a request read
whole, a whole answer or a streamed one; and the bytes of an answer's head.

Kept apart from the server so that the door's routes, proxy and errors need only these values,
and the server module holds the connection's rules (parsing, limits, deadlines) alone.
"""

from __future__ import annotations

import http
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any, Protocol, cast


class Connection(Protocol):
    """What a stream needs of the server's connection (``http1._Connection``)."""

    closed: bool
    transport: Any  # the loop's transport: asyncio's or uvloop's
    on_pressure: Callable[[bool], None] | None  # True: the client's buffer is full

    @property
    def write_paused(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


@dataclass
class Answer:
    """A whole answer: its status, body and headers (``Content-Length`` and ``Date`` are added);
    ``close``: close the connection after it."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False


def json_answer(doc: Any, status: int = 200, headers: dict[str, str] | None = None,
                close: bool = False) -> Answer:
    return Answer(status, json.dumps(doc).encode(),
                  {"Content-Type": "application/json", **(headers or {})}, close)


@dataclass(slots=True, eq=False)
class Request:
    """One request, its body read whole. ``headers``: lower-case names (repeated ones joined
    with ", "); ``path``: percent-decoded, without the query."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    remote: str
    http11: bool
    keep_alive: bool
    _conn: Connection | None = field(default=None, repr=False)
    _stream: Stream | None = field(default=None, repr=False)

    async def stream(self, status: int, headers: dict[str, str]) -> Stream:
        """Start a streamed answer (the handler then returns it)."""
        assert self._conn is not None and self._stream is None
        self._stream = Stream(self._conn, self, status, headers)
        await self._stream.start()
        return self._stream


Handler = Callable[[Request], Awaitable["Answer | Stream"]]


class Stream:
    """A streamed answer: ``write`` pieces as they come (each waits while the client's socket
    buffer is full), then ``end``. ``ConnectionResetError`` once the client has gone."""

    def __init__(self, conn: Connection, request: Request, status: int,
                 headers: dict[str, str]) -> None:
        self._conn = conn
        self._chunked = request.http11
        self._status = status
        self._headers = headers
        self.ended = False
        if not self._chunked:
            request.keep_alive = False  # HTTP/1.0: the end of the connection ends the answer

    async def start(self) -> None:
        extra = "Transfer-Encoding: chunked\r\n" if self._chunked else ""
        self._conn.write(answer_head(self._status, self._headers, extra, not self._chunked))
        await self._conn.drain()

    async def write(self, data: bytes) -> None:
        if data:
            self.send(data)
            await self._conn.drain()  # ConnectionResetError once the client has gone

    def send(self, data: bytes, raw: bool = False) -> None:
        """Write ``data`` now, without waiting (for a caller that keeps to ``pressure``);
        nothing once the client has gone, nor for no data (an empty chunk would end the
        answer)."""
        conn = self._conn
        if data and not conn.closed and conn.transport is not None:
            chunk = self._chunked and not raw
            conn.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if chunk else data)

    def pressure(self, hook: Callable[[bool], None] | None) -> None:
        """``hook(True)`` when the client's socket buffer fills, ``hook(False)`` when it has
        room again (None: no more calls)."""
        self._conn.on_pressure = hook
        if hook is not None and self._conn.write_paused:
            hook(True)

    async def end(self) -> None:
        if self.ended:
            return
        self.finish()
        await self._conn.drain()

    def finish(self, last: bytes = b"") -> None:
        """End the answer now, without waiting, ``last`` its last bytes (one write with the
        end: a write(2) a chunk is what the door spent beyond Envoy on streams)."""
        if not self.ended:
            self.ended = True
            if self._chunked:
                self.send(b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last) if last
                          else b"0\r\n\r\n", raw=True)
            elif last:
                self.send(last)


_DATE: list[Any] = [0, b""]


def _date() -> bytes:
    now = int(time.time())
    if _DATE[0] != now:
        _DATE[0], _DATE[1] = now, formatdate(now, usegmt=True).encode()
    return cast(bytes, _DATE[1])


_PHRASES = {int(s): s.phrase for s in http.HTTPStatus}


def _phrase(status: int) -> str:
    return _PHRASES.get(status, "Unknown")


def answer_head(status: int, headers: dict[str, str], extra: str, close: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_phrase(status)}\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            continue  # never let a value split the answer
        lines.append(f"{name}: {value}\r\n")
    lines.append(extra)
    if close:
        lines.append("Connection: close\r\n")
    return "".join(lines).encode("latin-1") + b"Date: " + _date() + b"\r\n\r\n"


def refusal(status: int, message: str, headers: dict[str, str] | None = None) -> Answer:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json_answer({"error": {"message": message, "type": kind, "param": None,
                                  "code": None}}, status, headers, close=True)
