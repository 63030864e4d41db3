"""Connection limits for every server here: how many, how many from one client, how long a head.

Why: in the embedded mode the front door, the reconciler and the agent are one process with one
file-descriptor table and one event loop. A slowloris of 20,000 half-sent request heads once took
that process to 19,693 of its 20,000 descriptors, and for as long as it lasted the agent could not
open a KV segment to set an outside write back, sample the GPU, or write a record. The servers had
no connection cap and no deadline for a request head. The rules, written once:

* ``Census``: a cap on live connections and a per-client (peer address) share of it. The cap is
  at most a fraction of the process's ``RLIMIT_NOFILE`` soft limit (``fd_share``), so no server
  can take the descriptors the control work needs; a connection over it is answered 503 at
  once, and closed after a moment spent dropping what it sent (so that its client reads the 503,
  not a reset), a moment only a sixteenth of the cap may spend at a time (``linger_s``);
* ``GuardedSite``: an aiohttp site (agent and reconciler API) whose connections go through the
  census and must send their first request head within ``head_s`` (a 408 and close otherwise;
  aiohttp itself bounds the heads after the first with its keep-alive timeout). The head is
  watched by httptools (llhttp), the parser the door uses, and only until the first head ends;
* ``quiet_accept_errors``: when ``accept()`` fails for want of descriptors (EMFILE, ENFILE), one
  warning line a minute instead of asyncio's traceback for every refused connection (uvloop's
  libuv accepts and closes such connections itself, silently).

It imports no package of the agent or the reconciler (``.importlinter``).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import socket
import time
from collections.abc import Callable
from typing import Any, cast

import httptools
from aiohttp import web
from msgspec import Struct

log = logging.getLogger("guard.conns")

OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)
QUIET_S = 60.0  # at most one "out of file descriptors" line this often
REFUSED_LINGER_S = 0.5  # a refused connection reads off what it sent for this long, then closes


def fd_share(fraction: int) -> int:
    """``1/fraction`` of this process's soft limit on open files (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft // fraction)


class ConnLimits(Struct, frozen=True):
    """A server's limits. ``max_connections`` is what was configured: the cap in force is at
    most ``1/fd_fraction`` of the soft fd limit (``cap``). ``per_client`` 0: half the cap."""

    max_connections: int = 1024
    per_client: int = 0
    head_s: float = 10.0  # the whole request head, from the connection (or, at the door, from
    body_s: float = 60.0  # its first byte after an answer); the body, from the head's end
    fd_fraction: int = 8

    def cap(self) -> int:
        return max(1, min(self.max_connections, fd_share(self.fd_fraction)))

    def census(self) -> Census:
        cap = self.cap()
        share = self.per_client if self.per_client > 0 else max(1, cap // 2)
        return Census(cap, min(share, cap))


API_LIMITS = ConnLimits()  # the agent's and the reconciler's API: 1024, an eighth of the fds


class Census:
    """Live connections, in all and per peer address: ``admit`` before serving one (False: over
    the cap or the peer's share), ``leave`` when an admitted one ends."""

    __slots__ = ("cap", "share", "live", "_peers", "refused", "lingering")

    def __init__(self, cap: int, share: int) -> None:
        self.cap = cap
        self.share = share
        self.live = 0
        self._peers: dict[str, int] = {}
        self.refused = 0  # connections refused since the start (for tests and logs)
        self.lingering = 0  # refused connections not yet closed

    def admit(self, peer: str) -> bool:
        held = self._peers.get(peer, 0)
        if self.live >= self.cap or held >= self.share:
            self.refused += 1
            return False
        self.live += 1
        self._peers[peer] = held + 1
        return True

    def leave(self, peer: str) -> None:
        self.live -= 1
        held = self._peers.get(peer, 0) - 1
        if held > 0:
            self._peers[peer] = held
        else:
            self._peers.pop(peer, None)

    def linger_s(self) -> float:
        """How long a refused connection may stay to read off what it sent, so that its client
        gets the answer rather than a reset (closing with unread bytes resets): a moment, and
        none while a sixteenth of the cap lingers already. Counts it until ``lingered``."""
        self.lingering += 1
        return REFUSED_LINGER_S if self.lingering <= max(8, self.cap // 16) else 0.0

    def lingered(self) -> None:
        self.lingering -= 1

    def why(self, peer: str) -> str:
        """What a refused connection is told."""
        if self.live < self.cap:
            return (f"This client holds {self.share} connections, its share of this server's "
                    f"{self.cap}; reuse them (keep-alive) or close some.")
        return f"This server holds its limit of {self.cap} connections; try again shortly."


def peer_of(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "-"


def error_bytes(status: int, message: str, phrase: str, extra: str = "") -> bytes:
    """A whole answer that closes the connection, in OpenAI's error shape (the door's) which
    also carries the ``error``/``message`` pair the agent's clients read."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": None}}).encode()
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\nContent-Length: "
            f"{len(body)}\r\n{extra}Connection: close\r\n\r\n").encode("latin-1") + body


def refuse(transport: asyncio.BaseTransport, census: Census, peer: str) -> None:
    """Answer a connection over the cap 503, read off (and drop) what it sends for a moment
    (``Census.linger_s``), and close it."""
    transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport
    transport.write(error_bytes(503, census.why(peer), "Service Unavailable",
                                "Retry-After: 1\r\n"))
    linger = census.linger_s()
    if linger <= 0:
        transport.close()
        return
    if transport.can_write_eof():
        transport.write_eof()
    asyncio.get_running_loop().call_later(linger, transport.abort)


class _Guarded(asyncio.Protocol):
    """An aiohttp connection behind the census and the first head's deadline; everything else is
    passed to aiohttp's own protocol unchanged."""

    def __init__(self, inner: asyncio.Protocol, census: Census, head_s: float) -> None:
        self._inner = inner
        self._census = census
        self._head_s = head_s
        self._peer = "-"
        self._admitted = False
        self._transport: asyncio.Transport | None = None
        self._watch: httptools.HttpRequestParser | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._peer = peer_of(transport)
        if not self._census.admit(self._peer):
            refuse(transport, self._census, self._peer)
            return
        self._admitted = True
        self._transport = cast(asyncio.Transport, transport)
        self._watch = httptools.HttpRequestParser(self)
        self._timer = asyncio.get_running_loop().call_later(self._head_s, self._late)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        if self._watch is not None:
            try:
                self._watch.feed_data(data)
            except httptools.HttpParserError:  # aiohttp answers it (400), or it is an upgrade
                self._head_done()
        self._inner.data_received(data)

    def on_headers_complete(self) -> None:  # the watching parser's callback
        self._head_done()

    def _head_done(self) -> None:
        self._watch = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self) -> None:
        self._timer = None
        transport = self._transport
        if self._watch is None or transport is None or transport.is_closing():
            return
        self._watch = None
        transport.write(error_bytes(408, f"The request's head did not arrive within "
                                    f"{self._head_s:g} s.", "Request Timeout"))
        transport.close()

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            self._census.lingered()  # a refused one
            return
        self._admitted = False
        self._census.leave(self._peer)
        self._head_done()
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()


class GuardedSite(web.BaseSite):
    """An aiohttp site on ``host:port`` or on a bound ``sock``, whose connections are guarded by
    ``limits`` (``census`` holds the live count)."""

    __slots__ = ("_host", "_port", "_sock", "census", "_head_s")

    def __init__(self, runner: web.BaseRunner, limits: ConnLimits, *, host: str | None = None,
                 port: int = 0, sock: socket.socket | None = None) -> None:
        super().__init__(runner)
        self._host, self._port, self._sock = host, port, sock
        self.census = limits.census()
        self._head_s = limits.head_s

    @property
    def name(self) -> str:
        return f"http://{self._host or '0.0.0.0'}:{self._port}"

    @property
    def port(self) -> int:
        sockets = getattr(self._server, "sockets", None)
        return int(sockets[0].getsockname()[1]) if sockets else self._port

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        census, head_s = self.census, self._head_s

        def guarded() -> asyncio.Protocol:
            return _Guarded(server(), census, head_s)

        if self._sock is not None:
            self._server = await loop.create_server(guarded, sock=self._sock,
                                                    backlog=self._backlog)
        else:
            self._server = await loop.create_server(guarded, self._host, self._port,
                                                    backlog=self._backlog, reuse_address=True)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop,
                        clock: Callable[[], float] = time.monotonic) -> None:
    """Install a loop exception handler that turns "accept() failed: out of file descriptors"
    into one warning line a minute; anything else goes to the handler that was there."""
    previous = loop.get_exception_handler()
    last = [-QUIET_S]

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in OUT_OF_FDS:
            now = clock()
            if now - last[0] >= QUIET_S:
                last[0] = now
                soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
                log.warning("out of file descriptors (soft limit %d): new connections are "
                            "refused for a moment; engines are still supervised (%s)", soft, exc)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
