"""A lean HTTP/1.1 client for the door's requests to engines: pooled keep-alive connections,
one request at a time on each, the answer handed on as it arrives.

Why not aiohttp's client, which the door uses for everything else (``/tokenize``,
``/v1/models``): on this path it is most of the door's cost. Measured on the 2-core bench
machine, a do-nothing aiohttp proxy spent 250-500 us of CPU per request with aiohttp's client
and 135-155 us with a bare protocol like this one (``bench/RESULTS.md``, figure 9). The door
needs little of what a general client does: no cookies, redirects, proxies, authentication,
decompression or URL handling; the engines are on known addresses and speak plain HTTP/1.1.

``ResponseParser`` is pure (bytes in, events out): the status line and headers, then a body by
``Content-Length``, by chunked transfer coding (chunk extensions and trailers skipped), or until
the connection closes; interim 1xx answers are skipped. ``Upstream.post`` sends a request on an
idle pooled connection (or a new one) and returns once the answer's head is in; a pooled
connection the engine closed meanwhile (uvicorn closes idle ones after 5 s) is retried once on a
new connection, which is safe because the engine never saw that request. The body is read with
``read()`` or ``chunks()``; more than ``limit`` bytes unread pause reading from the engine, so a
slow client slows the engine's stream rather than filling the door's memory. A stream is
``pipe()``d instead: each piece goes to a sink in the protocol's callback, and ``hold()`` stops
reading while the sink's client is full (the door's streams). ``release()`` puts a
finished connection back in the pool and closes an unfinished one (a client that went away), so
the engine sees the disconnect and aborts the request.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import cast

MAX_HEAD_BYTES = 64 << 10
READ_LIMIT = 256 << 10
CONNECT_TIMEOUT_S = 10.0
IDLE_PER_ENGINE = 256


class UpstreamError(Exception):
    """The engine could not be reached, or broke off its answer."""


@dataclass(frozen=True)
class Head:
    status: int
    headers: Mapping[str, str]  # lower-case names (the first of repeated ones)
    keep_alive: bool


class ResponseParser:
    """HTTP/1.1 response framing: ``feed`` bytes, get the head, body pieces and the end."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._state = "head"  # head, length, chunk-size, chunk-data, chunk-crlf, trailer, close
        self._left = 0
        self.head: Head | None = None
        self.done = False

    def feed(self, data: bytes) -> list[bytes]:
        """Body pieces completed by ``data`` (the head, once parsed, is ``self.head``; the end
        sets ``self.done``)."""
        self._buf += data
        out: list[bytes] = []
        while self._step(out):
            pass
        return out

    def eof(self) -> None:
        """The connection closed: the end of an until-close body, else a broken answer."""
        if self._state == "close" and not self.done:
            self.done = True
        elif not self.done:
            raise UpstreamError("the engine closed the connection before the end of its answer")

    def _step(self, out: list[bytes]) -> bool:
        buf, state = self._buf, self._state
        if self.done:
            if buf:
                raise UpstreamError("the engine sent bytes after its answer")
            return False
        if state == "head":
            head = _cut(buf, b"\r\n\r\n", "the head")
            return head is not None and self._start(head)
        if state in ("length", "chunk-data"):
            if not buf:
                return False
            piece = bytes(buf[:self._left])
            del buf[:len(piece)]
            self._left -= len(piece)
            out.append(piece)
            if self._left == 0:
                self._state = "chunk-crlf" if state == "chunk-data" else "head"
                if state == "length":
                    self.done = True
            return True
        if state == "close":
            if buf:
                out.append(bytes(buf))
                buf.clear()
            return False
        line = _cut(buf, b"\r\n", "a chunk line")
        if line is None:
            return False
        if state == "chunk-crlf":
            if line:
                raise UpstreamError("a chunk of the engine's answer does not end with CRLF")
            self._state = "chunk-size"
        elif state == "chunk-size":
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise UpstreamError(f"a bad chunk size in the engine's answer: {line!r}") from None
            if size == 0:
                self._state = "trailer"
            else:
                self._state, self._left = "chunk-data", size
        elif not line:  # the empty line after the (skipped) trailers
            self.done = True
            self._state = "head"
        return True

    def _start(self, raw: bytes) -> bool:
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise UpstreamError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise UpstreamError(f"a bad header line in the engine's answer: {line[:80]!r}")
            headers.setdefault(name.strip().lower().decode("latin-1"),
                               value.strip().decode("latin-1"))
        if 100 <= status < 200:  # interim (100 Continue): the real head follows
            return True
        connection = headers.get("connection", "").lower()
        keep = parts[0] == b"HTTP/1.1" and "close" not in connection or "keep-alive" in connection
        encoding = headers.get("transfer-encoding", "").lower()
        if status in (204, 304):
            self.done = True
        elif "chunked" in encoding:
            self._state = "chunk-size"
        elif "content-length" in headers:
            try:
                self._left = int(headers["content-length"])
            except ValueError:
                raise UpstreamError("a bad Content-Length in the engine's answer") from None
            self._state = "length"
            self.done = self._left == 0
        else:
            self._state, keep = "close", False
        self.head = Head(status, headers, keep)
        return True


def _cut(buf: bytearray, separator: bytes, what: str) -> bytes | None:
    """What ``buf`` holds before ``separator`` (both taken out of it); None while incomplete."""
    end = buf.find(separator)
    if end < 0:
        if len(buf) > MAX_HEAD_BYTES:
            raise UpstreamError(f"{what} of the engine's answer is too long")
        return None
    piece = bytes(buf[:end])
    del buf[:end + len(separator)]
    return piece


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self._loop = loop
        self._limit = limit
        self.transport: asyncio.Transport | None = None
        self.parser = ResponseParser()
        self.received = False  # any byte of the current answer
        self.closed = False
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[bytes], None] | None = None  # takes pieces as they arrive (pipe)
        self.sink_end: Callable[[], None] | None = None  # told the answer ended, as it ends
        self._held = False  # reading stopped by the pipe's client (hold)

    # ---- protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP connection's transport; uvloop's does not subclass asyncio.Transport
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            pieces = self.parser.feed(data)
        except UpstreamError as err:
            self._fail(err)
            return
        sink = self.sink
        if sink is not None:  # piped: handed on in this callback, no task woken per piece
            for piece in pieces:
                sink(piece)
            if self.parser.done:
                end, self.sink_end = self.sink_end, None
                if end is not None:
                    end()
                self._wake()
            return
        for piece in pieces:
            self._pieces.append(piece)
            self._buffered += len(piece)
        if self._buffered > self._limit and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        try:
            self.parser.eof()
        except UpstreamError as err:
            self._error = self._error or (UpstreamError(f"{err} ({exc})") if exc else err)
        self._wake()

    def _fail(self, err: Exception) -> None:
        self._error = err
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        await self._waiter

    # ---- one exchange ---------------------------------------------------------------------

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.parser = ResponseParser()
        self.received = False
        self.transport.write(request)

    async def head(self) -> Head:
        while self.parser.head is None:
            if self._error is not None:
                raise self._error
            if self.closed:
                raise UpstreamError("the engine closed the connection without answering")
            await self._wait()
        return self.parser.head

    async def piece(self) -> bytes | None:
        """The next body piece; None at the end."""
        while not self._pieces:
            if self._error is not None:
                raise self._error
            if self.parser.done:
                return None
            if self.closed:
                raise UpstreamError("the engine closed the connection mid-answer")
            await self._wait()
        piece = self._pieces.popleft()
        self._buffered -= len(piece)
        if self._paused and self._buffered <= self._limit // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return piece

    async def pipe(self, sink: Callable[[bytes], None],
                   end: Callable[[], None] | None = None) -> None:
        """Every body piece to ``sink`` (those buffered now, then each as it arrives, in the
        protocol's callback), and ``end()`` in the callback that completes the answer; returns
        at the end of the answer."""
        while self._pieces:
            piece = self._pieces.popleft()
            self._buffered -= len(piece)
            sink(piece)
        if self._paused and self.transport is not None:
            self._paused = False
            if not self._held:  # the sink's client may have filled up meanwhile
                self.transport.resume_reading()
        self.sink, self.sink_end = sink, end
        try:
            while not self.parser.done:
                if self._error is not None:
                    raise self._error
                if self.closed:
                    raise UpstreamError("the engine closed the connection mid-answer")
                await self._wait()
        finally:
            self.sink = self.sink_end = None
            self.hold(False)  # never back to the pool with reading stopped
        if self._error is not None:
            raise self._error

    def hold(self, held: bool) -> None:
        """Stop (True) or go on (False) reading the engine's answer: the client's socket is
        full, or has room again."""
        if self.transport is not None and not self.closed and held != self._held:
            self._held = held
            if held:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    @property
    def reusable(self) -> bool:
        head = self.parser.head
        return (not self.closed and self._error is None and self.parser.done
                and head is not None and head.keep_alive and not self._pieces)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """An engine's answer: ``status``, ``headers``, then ``read()``, ``chunks()`` or ``pipe()``;
    always ``release()`` it."""

    def __init__(self, upstream: Upstream, key: tuple[str, int], conn: _Connection,
                 head: Head) -> None:
        self._upstream = upstream
        self._key = key
        self._conn: _Connection | None = conn
        self.status = head.status
        self.headers = head.headers

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";", 1)[0].strip().lower()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        assert self._conn is not None
        while (piece := await self._conn.piece()) is not None:
            yield piece

    async def pipe(self, sink: Callable[[bytes], None],
                   end: Callable[[], None] | None = None) -> None:
        """Hand each body piece to ``sink`` as it arrives, with no task switch between the
        engine's socket and ``sink``, and call ``end`` as the answer completes (not when it
        breaks off); returns at the end (``UpstreamError`` if broken off). ``hold`` stops
        reading meanwhile (backpressure)."""
        assert self._conn is not None
        await self._conn.pipe(sink, end)

    def hold(self, held: bool) -> None:
        if self._conn is not None:
            self._conn.hold(held)

    async def read(self) -> bytes:
        assert self._conn is not None
        pieces = []
        while (piece := await self._conn.piece()) is not None:
            pieces.append(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.reusable:
            self._upstream._give_back(self._key, conn)
        else:
            conn.abort()


class Upstream:
    """Pooled keep-alive connections to engines, by (host, port)."""

    def __init__(self, limit: int = READ_LIMIT, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self._limit = limit
        self._connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(self, host: str, port: int, path: str, headers: Mapping[str, str],
                   body: bytes) -> Response:
        """Send ``body``; the answer once its head is in (``UpstreamError`` if none)."""
        key = (host, port)
        request = _request(host, port, path, headers, body)
        for attempt in range(2):
            conn = self._take(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(host, port)
            try:
                conn.send(request)
                head = await conn.head()
            except UpstreamError:
                conn.abort()
                if reused and not conn.received and attempt == 0:
                    continue  # closed while idle: the engine never saw this request
                raise
            except BaseException:
                conn.abort()  # cancelled: the engine sees the disconnect
                raise
            return Response(self, key, conn, head)
        raise AssertionError("unreachable")

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    def _give_back(self, key: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < IDLE_PER_ENGINE:
            idle.append(conn)
        else:
            conn.abort()

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:  # not wait_for: on 3.11 a cancel (the client left) that comes with the
            # connection is swallowed, and the connection with it
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, self._limit), host, port)
        except (OSError, asyncio.TimeoutError) as err:
            raise UpstreamError(f"cannot connect to {host}:{port}: "
                                f"{err or type(err).__name__}") from err
        return conn

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()


def authority(host: str, port: int) -> str:
    """``host:port`` as a URL and a Host header write it: an IPv6 address in brackets (a Pod's
    IP on an IPv6 cluster is the engine's host)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _request(host: str, port: int, path: str, headers: Mapping[str, str], body: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {authority(host, port)}",
             f"Content-Length: {len(body)}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            continue  # never let a header value split the request
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
