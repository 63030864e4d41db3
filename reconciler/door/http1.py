"""The door's HTTP/1.1 server: requests parsed by httptools, answers written whole or streamed
(the values it hands handlers and takes back: ``answers``).

Why not aiohttp's server, which every other HTTP endpoint here uses: on the door's path it is
most of what the door adds to a request. Measured on the 2-core bench machine, one keep-alive
client posting a small JSON body and reading a 300-byte answer, sequentially: aiohttp's web
application 86-96 us per round trip at p50 (84-90 us of server CPU a request), its low-level
server 69-86 us, this server's shape (httptools, a task per request) 33-38 us (20-24 us of CPU).
The door needs little of what a general server does: no routing tables, middlewares, cookies,
multipart, compression or WebSockets.

What it does:

* keep-alive, and pipelined requests answered in order (more than ``MAX_QUEUED`` waiting
  pause reading from the client);
* request bodies by ``Content-Length`` or chunked, up to ``max_body`` bytes (past it: 413 and
  the connection closed, at the head when ``Content-Length`` says so); ``Expect: 100-continue``
  is answered ``100 Continue`` when the body will be taken (curl sends it for bodies over 1 KiB);
* a request for an upgrade (``Upgrade: h2c``, as ``curl --http2`` sends over plain HTTP) is
  answered in HTTP/1.1, as RFC 9110 lets a server do;
* answers whole (``Answer``, with ``Content-Length``) or streamed (``Request.stream``: chunked
  transfer coding; to an HTTP/1.0 client the stream ends with the connection). A stream's writes
  wait while the client's socket buffer is full (backpressure);
* a client that disconnects cancels its request's handler (the door leaves the queue it waited
  in and closes its engine connection); a handler's exception is logged and answered 500;
* an idle keep-alive connection is closed after ``keepalive_s``; ``stop`` stops listening, closes
  idle connections, gives handlers in progress up to ``shutdown_s`` and then cancels them;
* a malformed request is answered 400 (the parser's reason) and the connection closed; so is an
  HTTP/1.1 request without ``Host`` and any request with two (RFC 9112 3.2).

Hard limits (``guard.conns.ConnLimits``), because in the embedded mode the door shares its
process, file descriptors and event loop with the agent that holds KV limits (issue 21):

* a connection cap, at most a quarter of the soft ``RLIMIT_NOFILE``, and a per-client (peer
  address) share of it: a connection over either is answered 503 at once and closed;
* a request head must be whole within ``head_s`` of the connection (the first) or of its first
  byte (the next ones, after an answer), and a body within ``body_s`` of its head: 408 and
  close otherwise. A byte does not move these deadlines, as it moved the idle clock before (a
  slowloris sent one byte a minute). They and the keep-alive idle timeout share one timer a
  connection, which wakes at most every ``min(head_s, body_s, keepalive_s)`` while it runs and
  never while a handler answers, so a request costs no timer of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import cast
from urllib.parse import unquote

import httptools

from contract.numbers import MAX_DIGITS, whole_number
from guard.conns import Census, ConnLimits, peer_of
from reconciler.door.answers import Answer, Handler, Request, Stream, answer_head, json_answer
from reconciler.door.answers import refusal as _error

__all__ = ["Answer", "Handler", "Request", "Server", "Stream", "json_answer"]

log = logging.getLogger("reconciler.door")

MAX_HEAD_BYTES = 64 << 10  # the request line and headers together
MAX_QUEUED = 16  # pipelined requests waiting behind the one being answered
KEEPALIVE_S = 75.0
SHUTDOWN_S = 2.0
LINGER_S, LINGER_BYTES = 2.0, 1 << 20  # after a refusal: what is read and discarded at most
DOOR_LIMITS = ConnLimits(max_connections=4096, fd_fraction=4)  # DoorSettings' defaults
# what a connection's clock waits for: another request, a head, a body, the client to read
IDLE, HEAD, BODY, READ = 0, 1, 2, 3


def _head_too_large() -> Answer:
    return _error(431, f"The request's head is over {MAX_HEAD_BYTES} bytes.")


def _host_problem(headers: dict[str, str], http11: bool, hosts: int) -> str | None:
    """RFC 9112 3.2: a server answers 400 to an HTTP/1.1 request without ``Host`` and to any
    request with more than one."""
    if hosts > 1:
        return "The request carries more than one Host header; send exactly one."
    if http11 and "host" not in headers:
        return "An HTTP/1.1 request must carry a Host header (RFC 9112 3.2)."
    return None


class _Connection(asyncio.Protocol):
    # slots: thirty attributes are past what CPython's shared instance dicts keep fast
    __slots__ = ("_server", "_loop", "transport", "_parser", "_remote", "_queue", "_queued_bytes",
                 "_task", "_timer", "_due", "_due_kind", "_partial", "_admitted",
                 "_paused_reading", "_refusing", "_lingering", "_writable", "on_pressure",
                 "closed", "_in_head", "_head_raw", "_upgrade", "_upgrade_left", "_url",
                 "_headers", "_hosts", "_head_bytes", "_body", "_size", "_refused")

    def __init__(self, server: Server) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()  # protocols are made by the loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._remote = "-"
        self._queue: deque[Request | Answer] = deque()
        self._queued_bytes = 0  # the bodies of the queued requests
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None  # the clock: idle, head and body
        self._due: float | None = None  # when the clock runs out; None: stopped (answering)
        self._due_kind = HEAD  # what it waits for; a new connection: its first head
        self._partial = False  # the parser holds part of a request (between begin and complete)
        self._admitted = False  # counted in the server's census
        self._paused_reading = False
        self._refusing = False  # a refusal is queued: read nothing more but to discard it
        self._lingering = 0  # bytes still to discard after a refusal, before the close
        self._writable: asyncio.Future[None] | None = None
        self.on_pressure: Callable[[bool], None] | None = None  # True: the client's buffer is full
        self.closed = False
        self._in_head = True  # between requests, or in one's head (not in its body)
        self._head_raw = 0  # bytes fed while in a head (the parser holds a partial one)
        self._upgrade: Request | None = None  # an upgrade request whose body is read here
        self._upgrade_left = 0
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._headers: dict[str, str] = {}
        self._hosts = 0  # Host headers beyond the first, plus one (counted only when repeated)
        self._head_bytes = 0  # the request line's target and the headers, as parsed
        self._body: list[bytes] = []
        self._size = 0
        self._refused: Answer | None = None  # an answer given instead of reading the body

    # ---- the transport ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport
        self._remote = peer_of(transport)
        census = self._server.census
        if not census.admit(self._remote):  # over the cap: 503 at once, nothing read
            self._send(_error(503, census.why(self._remote), {"Retry-After": "1"}), None,
                       census.linger_s())
            return
        self._admitted = True
        self._server.connections.add(self)
        self._clock(HEAD, self._server.head_s)  # the first head: from the connection

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._server.connections.discard(self)
        if self._admitted:
            self._admitted = False
            self._server.census.leave(self._remote)
        else:
            self._server.census.lingered()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client went away: its handler stops
        self._queue.clear()
        self._wake_writer()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self._loop.create_future()
        if self.on_pressure is not None:
            self.on_pressure(True)

    def resume_writing(self) -> None:
        self._wake_writer()
        if self.on_pressure is not None:
            self.on_pressure(False)
        if self._task is None:
            self._next()  # answers wait while the client does not read them

    def _wake_writer(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def write(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if self._writable is not None:
            await asyncio.shield(self._writable)
            if self.closed:
                raise ConnectionResetError("the client closed the connection")

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # after a refusal: discarded, so that the close resets nothing
            self._lingering = max(0, self._lingering - len(data))
            if not self._lingering:
                self._close()
            return
        if self._refusing:
            return
        while data:
            if self._upgrade is not None:
                data = self._upgrade_body(data)
                continue
            if self._in_head:
                self._head_raw += len(data)
            try:
                self._parser.feed_data(data)
                data = b""
            except httptools.HttpParserUpgrade as upgrade:
                # answered in HTTP/1.1 (RFC 9110 7.8: a server may ignore an upgrade); the
                # parser stops after the head, so the body is read here and what follows goes
                # to a new parser
                self._parser = httptools.HttpRequestParser(self)
                at = upgrade.args[0] if upgrade.args and isinstance(upgrade.args[0], int) \
                    else len(data)
                data = data[at:]
            except httptools.HttpParserError as err:
                answer, self._refused = self._refused, None
                self._refuse(answer or _error(400, f"A malformed HTTP request: {err}."))
                return
            if self._in_head and self._head_raw > MAX_HEAD_BYTES:
                self._refuse(_head_too_large())
                return
        if self._partial and self._due is not None:  # part of a request: its deadline runs
            kind = HEAD if self._in_head else BODY  # (a whole one in one read needs none)
            if kind != self._due_kind:
                self._clock(kind, self._server.head_s if kind == HEAD else self._server.body_s)

    def _upgrade_body(self, data: bytes) -> bytes:
        """Take an upgrade request's body off ``data`` (the rest: the next requests)."""
        request = self._upgrade
        assert request is not None
        piece, rest = data[:self._upgrade_left], data[self._upgrade_left:]
        self._body.append(piece)
        self._upgrade_left -= len(piece)
        if not self._upgrade_left:
            request.body = b"".join(self._body)
            self._upgrade, self._partial = None, False
            self._body = []
            self._enqueue(request)
        return rest

    def _refuse(self, answer: Answer) -> None:
        """Answer ``answer`` after what is queued, and read nothing more."""
        self._refusing = True
        self._queue.append(answer)
        if self.transport is not None and not self._paused_reading:
            self._paused_reading = True
            self.transport.pause_reading()
        self._next()

    # ---- parser callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reset()
        self._partial = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a chunked body's trailer: never taken for a header
        self._head_bytes += len(name) + len(value)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        known = self._headers.get(key)
        if known is None:
            self._headers[key] = text
        else:
            self._headers[key] = f"{known}, {text}"
            if key == "host":
                self._hosts = max(self._hosts, 1) + 1

    def on_headers_complete(self) -> None:
        self._in_head, self._head_raw = False, 0
        if self._head_bytes > MAX_HEAD_BYTES:  # came whole in one read (else data_received)
            self._refused = _head_too_large()
            raise httptools.HttpParserError("the head is too large")
        if self._hosts or "host" not in self._headers:  # (one Host: nothing to judge)
            problem = _host_problem(self._headers, self._parser.get_http_version() == "1.1",
                                    self._hosts)
            if problem is not None:
                self._refused = _error(400, problem)
                raise httptools.HttpParserError("the Host header")
        limit = self._server.max_body
        length = self._headers.get("content-length", "").strip()
        if (whole_number(length) or 0) > limit or len(length) > MAX_DIGITS:
            self._refused = self._server.too_large()
            raise httptools.HttpParserError("the body is too large")  # read no more of it
        if self._headers.get("expect", "").lower() == "100-continue" and self.transport \
                and self._parser.get_http_version() == "1.1" and self._task is None \
                and not self._queue:  # never inside an answer being written
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._server.max_body:
            self._refused = self._server.too_large()
            raise httptools.HttpParserError("the body is too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_head, self._head_raw, self._partial = True, 0, False
        url = self._url
        if not url.startswith(b"/"):  # absolute form (http://host/path): routed by its path
            try:
                parsed = httptools.parse_url(url)
                url = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
            except httptools.HttpParserInvalidURLError:
                pass  # authority form (CONNECT) or "*": no route has it, so a 404
        raw_path, _, query = url.partition(b"?")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        parser = self._parser
        request = Request(parser.get_method().decode("latin-1"),
                          unquote(raw_path.decode("latin-1")), query.decode("latin-1"),
                          self._headers, body, self._remote, parser.get_http_version() == "1.1",
                          parser.should_keep_alive(), self)
        if parser.should_upgrade():
            length = self._headers.get("content-length", "0").strip() or "0"
            if "transfer-encoding" in self._headers or whole_number(length) is None:
                self._refused = _error(400, "A request with Upgrade must send its body with "
                                       "Content-Length.")
                raise httptools.HttpParserError("an upgrade with a chunked body")
            if size := whole_number(length) or 0:  # the parser skips its body: read here
                self._upgrade, self._upgrade_left, self._body = request, size, []
                self._partial = True  # its body's deadline still runs
                return
        self._enqueue(request)

    # ---- answering, one request at a time --------------------------------------------------

    def _enqueue(self, request: Request) -> None:
        self._queue.append(request)
        self._queued_bytes += len(request.body)
        self._flow()
        self._next()

    def _flow(self) -> None:
        """Stop reading while too much waits (requests or their bodies); go on at half."""
        if self.transport is None or self._refusing:
            return
        over = len(self._queue) > MAX_QUEUED or self._queued_bytes > self._server.max_body
        under = len(self._queue) <= MAX_QUEUED // 2 \
            and self._queued_bytes <= self._server.max_body // 2
        if over and not self._paused_reading:
            self._paused_reading = True
            self.transport.pause_reading()
        elif under and self._paused_reading:
            self._paused_reading = False
            self.transport.resume_reading()

    def _next(self) -> None:
        if self._task is not None or self.closed:
            return  # busy or gone
        if self._writable is not None:  # the client has not read the last answer yet
            self._clock(READ, self._server.keepalive_s)  # (resume_writing comes back here)
            return
        if not self._queue:
            if self._server.stopping:
                self._close()
            elif not self._partial:
                self._clock(IDLE, self._server.keepalive_s)
            elif self._in_head:  # part of the next head came while this answer was written
                self._clock(HEAD, self._server.head_s)
            else:
                self._clock(BODY, self._server.body_s)
            return
        item = self._queue.popleft()
        if isinstance(item, Answer):
            self._send(item, None)
            return
        self._queued_bytes -= len(item.body)
        self._flow()
        self._due = None  # no clock while a handler answers
        self._task = self._loop.create_task(self._answer(item))

    async def _answer(self, request: Request) -> None:
        try:
            result: Answer | Stream = await self._server.handler(request)
        except asyncio.CancelledError:
            if self.closed:
                return
            raise
        except ConnectionResetError:  # a write to this client failed: it is gone
            self._task = None
            self._close()
            return
        except Exception:
            log.exception("door: the handler of %s %s failed", request.method, request.path)
            result = _error(500, "The door failed to answer this request; see its log.")
            if request._stream is not None:  # a stream already begun cannot become an error
                self._task = None
                self._close()
                return
        if isinstance(result, Stream):
            self.on_pressure = None
            with contextlib.suppress(ConnectionResetError):
                await result.end()
            self._task = None
            if not request.keep_alive or self._server.stopping:
                self._close()
            else:
                self._next()
            return
        self._task = None
        self._send(result, request)

    def _send(self, answer: Answer, request: Request | None, linger_s: float = LINGER_S) -> None:
        """Write a whole answer; ``request`` None: a refusal of what could not be read."""
        if self.closed or self.transport is None:
            return
        close = answer.close or request is None or not request.keep_alive \
            or self._server.stopping
        extra = f"Content-Length: {len(answer.body)}\r\n"
        if request is not None and not request.http11 and not close:
            extra += "Connection: keep-alive\r\n"
        head = answer_head(answer.status, answer.headers, extra, close)
        if request is not None and request.method == "HEAD":
            self.transport.write(head)
        else:
            self.transport.write(head + answer.body)
        if request is None:
            self._linger(linger_s)
        elif close:
            self._close()
        else:
            self._next()

    def _linger(self, linger_s: float) -> None:
        """After a refusal: stop writing, read and discard what the client still sends (up to
        ``LINGER_BYTES``, for ``linger_s``), then close. Closing with unread bytes would reset
        the connection, and the client would see a reset instead of the answer."""
        assert self.transport is not None
        if linger_s <= 0:
            self._close()
            return
        self._lingering = LINGER_BYTES
        self._refusing = False
        self._queue.clear()
        with contextlib.suppress(OSError, RuntimeError, NotImplementedError):
            if self.transport.can_write_eof():
                self.transport.write_eof()
        if self._paused_reading:
            self._paused_reading = False
            self.transport.resume_reading()
        self._due = None
        self._loop.call_later(linger_s, self._close_lingered)

    def _close(self, abort: bool = False) -> None:
        self._server.connections.discard(self)
        if self.transport is not None and not self.closed:
            self.closed = True
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

    # the clock: one timer a connection that looks when it fires, rather than a timer made and
    # cancelled for every request. It never sleeps longer than ``tick_s``, the shortest of the
    # three timeouts, so a deadline set later (each is at least ``tick_s`` away) is never
    # earlier than the timer, and moving a deadline needs no new timer.

    def _clock(self, kind: int, seconds: float) -> None:
        if self.closed:
            return
        self._due = self._loop.time() + seconds
        self._due_kind = kind
        if self._timer is None:
            self._timer = self._loop.call_later(self._server.tick_s, self._tick)

    def _tick(self) -> None:
        self._timer = None
        due = self._due
        if self.closed or due is None or self._lingering:
            return  # answering (the next wait starts the clock again), or closing anyway
        left = due - self._loop.time()
        if left > 0:
            self._timer = self._loop.call_later(min(left, self._server.tick_s), self._tick)
        elif self._due_kind in (IDLE, READ) or not self._partial:
            # nothing of a request came, or the client does not read: closed without a word
            # (aborted when written bytes wait: a close would wait for them for ever)
            self._close(abort=self._unsent())
        else:
            what = "head" if self._due_kind == HEAD else "body"
            limit = self._server.head_s if self._due_kind == HEAD else self._server.body_s
            self._refuse(_error(408, f"The request's {what} did not arrive within {limit:g} s."))

    @property
    def write_paused(self) -> bool:
        """The client's socket buffer is full: writes wait (``drain``)."""
        return self._writable is not None

    def _unsent(self) -> bool:
        return self.transport is not None and self.transport.get_write_buffer_size() > 0

    def _close_lingered(self) -> None:
        self._close(abort=self._unsent())

    @property
    def busy(self) -> bool:
        return self._task is not None

    def cancel(self, abort: bool = False) -> asyncio.Task[None] | None:
        """Close the connection and cancel its handler; that handler's task, if any."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
        self._close(abort)
        return task


class Server:
    """``await start(host, port)`` (the port it got back), then ``await stop()``."""

    def __init__(self, handler: Handler, *, max_body: int, too_large: Callable[[], Answer],
                 keepalive_s: float = KEEPALIVE_S, shutdown_s: float = SHUTDOWN_S,
                 limits: ConnLimits = DOOR_LIMITS) -> None:
        self.handler = handler
        self.max_body = max_body
        self.too_large = too_large  # the 413 answer (its message names the limit)
        self.keepalive_s = keepalive_s
        self.shutdown_s = shutdown_s
        self.head_s, self.body_s = limits.head_s, limits.body_s
        self.tick_s = min(keepalive_s, limits.head_s, limits.body_s)
        self.limits = limits
        self.census: Census = limits.census()  # made again at start (the fd limit then)
        self.connections: set[_Connection] = set()
        self.stopping = False  # answers close their connections; no new request starts
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str | None, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.census = self.limits.census()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        sockets = getattr(self._server, "sockets", None)
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def stop(self) -> None:
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if not conn.busy:
                conn.cancel()
        deadline = time.monotonic() + self.shutdown_s
        while any(c.busy for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        tasks = [t for t in (c.cancel(abort=True) for c in list(self.connections))
                 if t is not None]
        if tasks:  # let the cancelled handlers run their cleanup
            await asyncio.wait(tasks, timeout=self.shutdown_s)
        if self._server is not None:
            await self._server.wait_closed()
