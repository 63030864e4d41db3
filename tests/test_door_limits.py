"""The hard limits of the door's server and of the API servers (``guard.conns``), against raw
sockets: slow and partial heads and bodies, connections over the cap and over a client's share,
pipelining up to a stalled head, clients that do not read, the Host rules of RFC 9112, and the
one-line report of an fd shortage at accept."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import uvloop
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.conns import ConnLimits, GuardedSite, quiet_accept_errors
from reconciler.door.http1 import Answer, Request, Server, Stream
from tests.test_door_http1 import read_answer, served

pytestmark = pytest.mark.timeout(60)
HEAD_S = 0.4


def get(path: str = "/a", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: d\r\n{extra}\r\n".encode()


@contextlib.asynccontextmanager
async def door(limits: ConnLimits = ConnLimits(head_s=HEAD_S, body_s=HEAD_S),
               keepalive_s: float = 5.0) -> AsyncIterator[tuple[Server, int]]:
    server, port = await served(keepalive_s=keepalive_s, limits=limits)
    try:
        yield server, port
    finally:
        await server.stop()


async def connect(port: int, source: str = "127.0.0.1"
                  ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def status_then_eof(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One answer, and the connection closed after it."""
    line, headers, body = await asyncio.wait_for(read_answer(reader), 5)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    return line, headers, body


# ---- deadlines --------------------------------------------------------------------------------


async def test_a_head_that_trickles_in_is_408_at_its_deadline_whatever_each_byte_does() -> None:
    async with door() as (_, port):
        started = time.monotonic()  # before the connection: the server's clock may start there
        reader, writer = await connect(port)
        writer.write(b"GET /a HTTP/1.1\r\nHost: d\r\n")
        answer = asyncio.ensure_future(status_then_eof(reader))
        while not answer.done() and time.monotonic() - started < 5:
            writer.write(b"X: 1\r\n")  # a byte every 50 ms: more than the idle clock allowed
            await asyncio.sleep(0.05)
        line, headers, body = await answer
        took = time.monotonic() - started
        assert line == b"HTTP/1.1 408 Request Timeout" and headers["connection"] == "close"
        assert json.loads(body)["error"]["message"] == \
            f"The request's head did not arrive within {HEAD_S:g} s."
        assert HEAD_S <= took < HEAD_S + 2.0
        writer.close()


async def test_a_body_slower_than_its_deadline_is_408() -> None:
    async with door() as (_, port):
        reader, writer = await connect(port)
        writer.write(b"POST /a HTTP/1.1\r\nHost: d\r\nContent-Length: 100\r\n\r\n")
        answer = asyncio.ensure_future(status_then_eof(reader))
        while not answer.done():
            writer.write(b"x")
            await asyncio.sleep(0.05)
        line, _, body = await answer
        assert line.startswith(b"HTTP/1.1 408") and b"body did not arrive" in body
        writer.close()


async def test_a_connection_that_sends_nothing_is_closed_without_a_word_at_the_deadline(
        ) -> None:
    async with door() as (server, port):
        # before the connection: the server's clock starts at its accept, which a loaded
        # machine may run before our connect() returns
        started = time.monotonic()
        reader, writer = await connect(port)
        try:
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert time.monotonic() - started >= HEAD_S
            assert server.census.live == 0
        finally:
            writer.close()


async def test_after_an_answer_the_idle_clock_waits_and_the_next_head_has_its_own_deadline(
        ) -> None:
    async with door(keepalive_s=30) as (_, port):
        reader, writer = await connect(port)
        writer.write(get())
        line, _, _ = await read_answer(reader)
        assert line == b"HTTP/1.1 200 OK"
        await asyncio.sleep(HEAD_S * 2)  # idle, longer than a head may take: still open
        writer.write(get("/b"))
        line, _, body = await read_answer(reader)
        assert line == b"HTTP/1.1 200 OK" and json.loads(body)["path"] == "/b"
        started = time.monotonic()
        writer.write(b"GET /c HTTP/1.1\r\n")  # a head begun and never finished
        line, _, _ = await status_then_eof(reader)
        assert line.startswith(b"HTTP/1.1 408")
        assert HEAD_S <= time.monotonic() - started < HEAD_S + 2.0
        writer.close()


@settings(max_examples=15, deadline=None)
@given(count=st.integers(min_value=0, max_value=5),
       cuts=st.lists(st.integers(min_value=1, max_value=200), max_size=6),
       stall=st.integers(min_value=1, max_value=20))
def test_pipelined_requests_are_answered_and_a_stalled_head_after_them_is_408(
        count: int, cuts: list[int], stall: int) -> None:
    """Whole requests, cut anywhere and pipelined, are answered in order; the head left
    unfinished after them is answered 408 and the connection closed; nothing stays counted."""
    raw = b"".join(get(f"/{i}") for i in range(count)) + get("/stalled")[:stall]

    async def run() -> None:
        async with door() as (server, port):
            reader, writer = await connect(port)
            start = 0
            for cut in sorted({c for c in cuts if c < len(raw)}) + [len(raw)]:
                writer.write(raw[start:cut])
                start = cut
                await asyncio.sleep(0.005)
            for i in range(count):
                line, _, body = await asyncio.wait_for(read_answer(reader), 5)
                assert line == b"HTTP/1.1 200 OK" and json.loads(body)["path"] == f"/{i}"
            line, _, _ = await status_then_eof(reader)
            assert line.startswith(b"HTTP/1.1 408")
            writer.close()
            for _ in range(100):
                if server.census.live == 0:
                    break
                await asyncio.sleep(0.01)
            assert server.census.live == 0 and not server.connections

    asyncio.run(run())


async def test_a_client_that_does_not_read_its_answer_is_dropped_after_the_idle_timeout(
        ) -> None:
    async def big(request: Request) -> Answer | Stream:
        return Answer(200, b"x" * (16 << 20))

    server, port = await served(big, keepalive_s=0.5, limits=ConnLimits(head_s=5, body_s=5))
    try:
        reader, writer = await connect(port)
        writer.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer.write(get())
        for _ in range(400):
            if not server.connections:
                break
            await asyncio.sleep(0.02)
        assert not server.connections and server.census.live == 0
        writer.close()
    finally:
        await server.stop()


# ---- the cap and the share ------------------------------------------------------------------


LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}  # the daemons run on uvloop


def run_on(loop: str, main: Coroutine[Any, Any, None]) -> None:
    LOOPS[loop](asyncio.wait_for(main, 20))


def on_both_loops(test: Callable[[str], None]) -> Callable[[str], None]:
    """Run ``test(loop)`` on asyncio's loop and on uvloop; a thread times it out (a uvloop left
    with a broken transport can hang in its close, where no signal reaches)."""
    return pytest.mark.timeout(40, method="thread")(pytest.mark.parametrize("loop", LOOPS)(test))


@on_both_loops
def test_connections_over_the_cap_are_answered_503_and_closed(loop: str) -> None:
    run_on(loop, over_the_cap())


async def over_the_cap() -> None:
    async with door(ConnLimits(max_connections=3, per_client=3)) as (server, port):
        held = [await connect(port) for _ in range(3)]
        for reader, writer in held:  # each is served
            writer.write(get())
            assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
        over_reader, over_writer = await connect(port)
        over_writer.write(get())
        line, headers, body = await status_then_eof(over_reader)
        over_writer.close()
        assert line == b"HTTP/1.1 503 Service Unavailable" and headers["retry-after"] == "1"
        error = json.loads(body)["error"]
        assert error["message"] == "This server holds its limit of 3 connections; try again " \
            "shortly." and error["type"] == "server_error"
        held[0][1].close()
        for _ in range(100):
            if server.census.live < 3:
                break
            await asyncio.sleep(0.01)
        reader, writer = await connect(port)
        writer.write(get())
        assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
        for _, w in held[1:] + [(reader, writer)]:
            w.close()


async def test_one_client_address_gets_only_its_share_and_another_still_gets_in() -> None:
    async with door(ConnLimits(max_connections=4, per_client=2)) as (_, port):
        mine = [await connect(port) for _ in range(2)]
        reader, writer = await connect(port)
        line, _, body = await status_then_eof(reader)
        assert line.startswith(b"HTTP/1.1 503") and b"its share" in body
        other_reader, other_writer = await connect(port, "127.0.0.2")
        other_writer.write(get())
        assert (await read_answer(other_reader))[0] == b"HTTP/1.1 200 OK"
        for _, w in mine + [(reader, writer), (other_reader, other_writer)]:
            w.close()


def test_the_cap_is_never_more_than_a_share_of_the_descriptor_limit() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert ConnLimits(max_connections=10**9, fd_fraction=4).cap() == max(16, soft // 4)
    census = ConnLimits(max_connections=10).census()
    assert (census.cap, census.share) == (10, 5)


# ---- Host (RFC 9112 3.2) ----------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "status"), [
    (b"GET /a HTTP/1.1\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\nHost: a\r\nhost: a\r\n\r\n", 400),
    (b"GET /a HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", 400),
    (b"GET /a HTTP/1.0\r\n\r\n", 200),
    (b"GET /a HTTP/1.1\r\nHost:\r\n\r\n", 200),
    (b"GET http://a/a HTTP/1.1\r\nHost: a\r\n\r\n", 200),
])
async def test_a_request_needs_exactly_one_host_in_http11_and_at_most_one_in_http10(
        raw: bytes, status: int) -> None:
    async with door() as (_, port):
        reader, writer = await connect(port)
        writer.write(raw)
        line, _, body = await asyncio.wait_for(read_answer(reader), 5)
        assert line.split()[1] == str(status).encode(), body
        if status == 400:
            assert b"Host" in body
        writer.close()


# ---- the API servers (aiohttp) ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def api(limits: ConnLimits) -> AsyncIterator[tuple[GuardedSite, int]]:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/healthz", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = GuardedSite(runner, limits, host="127.0.0.1", port=0)
    await site.start()
    try:
        yield site, site.port
    finally:
        await runner.cleanup()


@on_both_loops
def test_an_api_server_refuses_past_its_cap_and_times_out_a_slow_first_head(loop: str) -> None:
    run_on(loop, api_limits())


async def api_limits() -> None:
    async with api(ConnLimits(max_connections=2, per_client=2, head_s=HEAD_S)) as (site, port):
        reader, writer = await connect(port)
        writer.write(get("/healthz"))
        line, _, body = await read_answer(reader)
        assert line == b"HTTP/1.1 200 OK" and json.loads(body) == {"ok": True}
        slow_reader, slow_writer = await connect(port)
        slow_writer.write(b"GET /healthz HTTP/1.1\r\n")  # and no more
        over_reader, over_writer = await connect(port)
        line, _, body = await status_then_eof(over_reader)
        assert line.startswith(b"HTTP/1.1 503") and b"limit of 2 connections" in body
        line, _, body = await status_then_eof(slow_reader)
        assert line.startswith(b"HTTP/1.1 408") and b"did not arrive" in body
        writer.write(get("/healthz"))  # the first is kept alive, untouched by the deadline
        assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
        for w in (writer, slow_writer, over_writer):
            w.close()
        for _ in range(100):
            if site.census.live == 0:
                break
            await asyncio.sleep(0.01)
        assert site.census.live == 0


async def test_out_of_descriptors_at_accept_is_one_warning_line(
        caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    loop.set_exception_handler(lambda _, context: seen.append(context["message"]))
    try:
        quiet_accept_errors(loop)
        for _ in range(50):  # what asyncio reports for each connection it could not accept
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(errno.EMFILE, "Too many open files")})
        loop.call_exception_handler({"message": "something else"})
    finally:
        loop.set_exception_handler(None)
    lines = [r for r in caplog.records if r.name == "guard.conns"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "out of file descriptors" in lines[0].getMessage() and lines[0].exc_info is None
    assert seen == ["something else"]
