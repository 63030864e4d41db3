"""The one HTTP/1.1 client to engines (the door's proxy and asks, the agent's control calls via
``engine_http.calls``): pooled keep-alive connections, the answer handed on as it arrives.

Not aiohttp's client: on the door's path it was most of the door's cost (250-500 us of CPU a
request against 135-155 us with a bare protocol, ``bench/RESULTS.md`` figure 9), and engines
need no cookies, redirects, proxies or decompression. Their bytes are framed by llhttp
(``engine_http.framing``): an answer that breaks HTTP is an ``UpstreamError`` for its request,
and its connection is closed, never pooled.

``Upstream.request`` sends on an idle pooled connection (or a new one) and returns once the
answer's head is in; a pooled connection the engine closed meanwhile (uvicorn closes idle ones
after 5 s; an engine restarted on the same port closed them all) is retried once on a new one,
safe because the engine never saw that request; ``fresh=True`` takes a new one instead. An engine
silent for ``timeout`` seconds while it owes an answer (and the door not holding its reading
back) is given up with ``UpstreamTimeout``: one timer per connection that looks when it fires,
not one per request or read (``None``: no such clock, each call brings its own deadline). The
body is ``read()`` (at most ``MAX_ANSWER_BYTES``) or taken in ``chunks()``; more than ``limit``
bytes unread pause reading, so a slow client slows the engine rather than filling memory. A
stream is ``pipe()``d: each piece goes to a sink in the protocol's callback, and ``hold()``
stops reading while the sink's client is full. ``release()`` pools a finished connection and
closes any other (unfinished, broken, spent): the engine sees the disconnect and aborts.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping
from typing import cast

from engine_http.framing import (
    Head,
    ResponseParser,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)

MAX_ANSWER_BYTES = 256 << 20  # a whole answer read() (a stream is piped, never held whole)
READ_LIMIT = 256 << 10
CONNECT_TIMEOUT_S = 10.0
TIMEOUT_S = 600.0  # an engine silent this long mid-answer is given up
IDLE_PER_ENGINE = 256


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int,
                 timeout: float | None) -> None:
        self._loop = loop
        self._limit = limit
        self._timeout = timeout
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
        self.sink_end: Callable[[bytes], None] | None = None  # the end, with its last bytes
        self._held = False  # reading stopped by the pipe's client (hold)
        self._heard = 0.0  # loop time of the last byte (or of the request)
        self._stall: asyncio.TimerHandle | None = None

    # ---- protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP connection's transport; uvloop's does not subclass asyncio.Transport
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        self._heard = self._loop.time()
        parser = self.parser
        error: UpstreamError | None = None
        try:
            pieces = parser.feed(data)
        except UpstreamError as err:  # what came before the break is passed on first
            pieces, error = parser.taken(), err
        if parser.spent and self.transport is not None:
            self.transport.close()  # what it has sent stands; what follows is not ours
        self._hand_on(pieces)
        if error is not None:
            self._fail(error)

    def _hand_on(self, pieces: list[bytes]) -> None:
        parser = self.parser
        sink = self.sink
        if sink is not None:  # piped: handed on in this callback, no task woken per piece
            # One read's pieces go on as one: each sink call is a write(2) to the client
            # (strace counted 22 a streamed answer against Envoy's 3), and the answer's last
            # bytes go with its end.
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            if parser.done:
                end, self.sink_end = self.sink_end, None
                if end is not None:
                    end(data)
                elif data:
                    sink(data)
                self._wake()
            elif data:
                sink(data)
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
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
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

    # the stall clock: one timer that looks when it fires (as the door server's idle clock),
    # not one made and cancelled for every request or every read

    def _arm(self) -> None:
        self._heard = self._loop.time()
        if self._stall is None and not self.closed and self._timeout is not None:
            self._stall = self._loop.call_later(self._timeout, self._stall_check)

    def _stall_check(self) -> None:
        self._stall = None
        if self.closed or self.parser.done or self._error is not None:
            return  # not owed an answer now (the next request arms it again)
        now = self._loop.time()
        if self._held or self._paused:  # the door holds the reading back, not the engine
            self._heard = now
        timeout = cast(float, self._timeout)  # armed only with one
        left = self._heard + timeout - now
        if left <= 0:
            self._fail(UpstreamTimeout(f"the engine sent nothing for {timeout:g} s"))
        else:
            self._stall = self._loop.call_later(left, self._stall_check)

    # ---- one exchange ---------------------------------------------------------------------

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.parser.expect()  # a pooled connection's last answer ended cleanly (reusable)
        self.received = False
        self.transport.write(request)
        self._arm()

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
                   end: Callable[[bytes], None] | None = None) -> None:
        """Every body piece to ``sink`` (those buffered now, then each read's as it arrives, in
        the protocol's callback), and ``end(last)`` in the callback that completes the answer,
        with that read's bytes (``b""`` if none; they are not also given to ``sink``); returns
        at the end of the answer."""
        if self._pieces:  # what came before the pipe: one piece, one write
            buffered = b"".join(self._pieces)
            self._pieces.clear()
            self._buffered = 0
            sink(buffered)
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
        parser = self.parser
        head = parser.head
        return (not self.closed and self._error is None and parser.done and not parser.spent
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
        self.length = head.length

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";", 1)[0].strip().lower()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        assert self._conn is not None
        while (piece := await self._conn.piece()) is not None:
            yield piece

    async def pipe(self, sink: Callable[[bytes], None],
                   end: Callable[[bytes], None] | None = None) -> None:
        """Hand each body piece to ``sink`` as it arrives, with no task switch between the
        engine's socket and ``sink``, and call ``end(last)`` as the answer completes, with its
        last bytes, so they and the end are one write (not when it breaks off); returns at the
        end (``UpstreamError`` if broken off). ``hold`` stops reading meanwhile (backpressure)."""
        assert self._conn is not None
        await self._conn.pipe(sink, end)

    def hold(self, held: bool) -> None:
        if self._conn is not None:
            self._conn.hold(held)

    async def read(self, most: int = MAX_ANSWER_BYTES) -> bytes:
        """The whole body; ``UpstreamError`` past ``most`` bytes (said or sent)."""
        assert self._conn is not None
        if self.length is not None and self.length > most:
            raise UpstreamError(f"the engine's answer says it has {self.length} bytes, more "
                                f"than the door takes ({most})")
        pieces, size = [], 0
        while (piece := await self._conn.piece()) is not None:
            pieces.append(piece)
            size += len(piece)
            if size > most:
                raise UpstreamError(f"the engine's answer is over {most} bytes")
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

    def __init__(self, limit: int = READ_LIMIT, connect_timeout: float = CONNECT_TIMEOUT_S,
                 timeout: float | None = TIMEOUT_S) -> None:
        self._limit = limit
        self._connect_timeout = connect_timeout
        self._timeout = timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    def post(self, host: str, port: int, path: str, headers: Mapping[str, str],
             body: bytes) -> Coroutine[None, None, Response]:
        """``request("POST", ...)``, the door's proxy path (no coroutine frame of its own)."""
        return self.request("POST", host, port, path, headers, body)

    async def request(self, method: str, host: str, port: int, path: str,
                      headers: Mapping[str, str], body: bytes, fresh: bool = False) -> Response:
        """Send ``method path`` with ``body``; the answer once its head is in (``UpstreamError``
        if none). ``fresh``: on a new connection, never a pooled one (so never retried)."""
        key = (host, port)
        request = _request(method, host, port, path, headers, body)
        for attempt in range(2):
            conn = None if fresh else self._take(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(host, port)
            try:
                conn.send(request)
                head = await conn.head()
            except UpstreamError as err:
                conn.abort()
                if reused and not conn.received and attempt == 0 \
                        and not isinstance(err, UpstreamTimeout):
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
                    lambda: _Connection(loop, self._limit, self._timeout), host, port)
        except (OSError, asyncio.TimeoutError) as err:
            raise UpstreamUnreachable(f"cannot connect to {host}:{port}: "
                                      f"{err or type(err).__name__}") from err
        return conn

    async def __aenter__(self) -> Upstream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()


def authority(host: str, port: int) -> str:
    """``host:port`` as a URL and a Host header write it: an IPv6 address in brackets (a Pod's
    IP on an IPv6 cluster is the engine's host)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _request(method: str, host: str, port: int, path: str, headers: Mapping[str, str],
             body: bytes) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {authority(host, port)}",
             f"Content-Length: {len(body)}"]
    if not body and method == "GET":  # a GET without a body says no length (RFC 9110 8.6)
        del lines[2]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            continue  # never let a header value split the request
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
