"""The door's HTTP/1.1 client to engines: framing by length, chunks or close; keep-alive reuse,
a stale pooled connection retried, an unfinished answer never reused, backpressure, and a stall
clock that the door's own holding back never trips (hostile answers: ``test_door_framing``)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from engine_http.framing import ResponseParser, UpstreamError
from engine_http.upstream import Upstream, authority

pytestmark = pytest.mark.timeout(30)


def parse(raw: bytes, cuts: list[int] = ()) -> tuple[ResponseParser, bytes]:  # type: ignore[assignment]
    parser = ResponseParser()
    body = b""
    start = 0
    for cut in sorted(set(c for c in cuts if 0 < c < len(raw))) + [len(raw)]:
        body += b"".join(parser.feed(raw[start:cut]))
        start = cut
    return parser, body


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked"
           b"\r\n\r\n7\r\ndata: 1\r\n8;ext=1\r\n\n\ndata: \r\n0\r\nX-Trailer: t\r\n\r\n")


def test_a_chunked_answer_is_decoded_and_ends_after_its_trailers() -> None:
    parser, body = parse(CHUNKED)
    assert parser.head is not None and parser.head.status == 200 and parser.head.keep_alive
    assert parser.head.headers["content-type"] == "text/event-stream"
    assert body == b"data: 1\n\ndata: " and parser.done


@given(st.lists(st.integers(0, len(CHUNKED)), max_size=8))
def test_framing_does_not_depend_on_how_the_bytes_arrive(cuts: list[int]) -> None:
    parser, body = parse(CHUNKED, cuts)
    assert body == b"data: 1\n\ndata: " and parser.done


def test_a_length_answer_ends_at_its_length_and_an_interim_answer_is_skipped() -> None:
    raw = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n"
           b"Connection: close\r\n\r\nhello")
    parser, body = parse(raw, [3, 30])
    assert parser.head is not None and parser.head.status == 404 and not parser.head.keep_alive
    assert body == b"hello" and parser.done


def test_an_answer_without_length_runs_until_the_connection_closes() -> None:
    parser, body = parse(b"HTTP/1.0 200 OK\r\n\r\nabc")
    assert body == b"abc" and not parser.done
    parser.eof()
    assert parser.done and parser.head is not None and not parser.head.keep_alive


@pytest.mark.parametrize("raw", [b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort",
                                 b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"])
def test_a_cut_answer_is_an_error(raw: bytes) -> None:
    parser, _ = parse(raw)
    with pytest.raises(UpstreamError, match="before the end"):
        parser.eof()


@pytest.mark.parametrize("raw", [b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 200 OK\r\nbad\r\n\r\n",
                                 b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"])
def test_what_is_not_http_is_an_error(raw: bytes) -> None:
    with pytest.raises(UpstreamError):
        ResponseParser().feed(raw)


# ---- against a real server ----------------------------------------------------------------


@pytest.fixture
async def engine() -> AsyncIterator[tuple[int, list[str]]]:
    peers: list[str] = []

    async def echo(request: web.Request) -> web.StreamResponse:
        peers.append(str(request.transport.get_extra_info("peername")))  # type: ignore[union-attr]
        body = await request.read()
        if request.path == "/stream":
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i in range(int(body or b"3")):
                await out.write(b"x" * 1024 + str(i).encode())
            await out.write_eof()
            return out
        return web.Response(body=body, headers={"X-Request-Id": request.headers.get(
            "X-Request-Id", "")})

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_post("/stream", echo)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=0.3)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield port, peers
    await runner.cleanup()


async def test_answers_come_back_and_connections_are_reused(
        engine: tuple[int, list[str]]) -> None:
    port, peers = engine
    pool = Upstream()
    for i in range(3):
        resp = await pool.post("127.0.0.1", port, "/echo", {"X-Request-Id": f"r{i}"}, b"hi %d" % i)
        assert resp.status == 200 and await resp.read() == b"hi %d" % i
        assert resp.headers["x-request-id"] == f"r{i}"
        resp.release()
    assert len(set(peers)) == 1  # one keep-alive connection
    pool.close()


async def test_a_connection_the_engine_closed_while_idle_is_retried_once(
        engine: tuple[int, list[str]]) -> None:
    port, peers = engine
    pool = Upstream()
    resp = await pool.post("127.0.0.1", port, "/echo", {}, b"one")
    await resp.read()
    resp.release()
    await asyncio.sleep(0.6)  # the server's keep-alive timeout closed it
    resp = await pool.post("127.0.0.1", port, "/echo", {}, b"two")
    assert await resp.read() == b"two"
    resp.release()
    assert len(set(peers)) == 2
    pool.close()


async def test_an_unfinished_answer_closes_its_connection_and_a_finished_stream_is_reused(
        engine: tuple[int, list[str]]) -> None:
    port, peers = engine
    pool = Upstream(limit=4096)
    resp = await pool.post("127.0.0.1", port, "/stream", {}, b"200")
    pieces = resp.chunks()
    first = await pieces.__anext__()
    assert first.startswith(b"x")
    resp.release()  # a client that went away
    await pieces.aclose()
    resp = await pool.post("127.0.0.1", port, "/stream", {}, b"3")
    assert resp.content_type == "text/event-stream"
    assert len(await resp.read()) == 3 * 1025
    resp.release()
    resp = await pool.post("127.0.0.1", port, "/echo", {}, b"after")
    assert await resp.read() == b"after"
    resp.release()
    assert peers[-1] == peers[-2] != peers[0]  # the cut one is never reused
    pool.close()


async def test_a_slow_reader_pauses_reading_from_the_engine(
        engine: tuple[int, list[str]]) -> None:
    port, _ = engine
    pool = Upstream(limit=4096)
    resp = await pool.post("127.0.0.1", port, "/stream", {}, b"2000")  # ~2 MB
    await asyncio.sleep(0.3)
    conn = resp._conn
    assert conn is not None and conn._paused and conn._buffered < 200_000
    total = len(await resp.read())
    assert total == sum(1024 + len(str(i)) for i in range(2000))
    resp.release()
    pool.close()


async def test_a_pipe_hands_on_every_piece_and_a_held_connection_goes_back_reading(
        engine: tuple[int, list[str]]) -> None:
    port, peers = engine
    pool = Upstream()
    resp = await pool.post("127.0.0.1", port, "/stream", {}, b"50")
    got: list[bytes] = []

    def full_client(piece: bytes) -> None:  # a client whose socket is full after each piece
        got.append(piece)
        resp.hold(True)
        asyncio.get_running_loop().call_soon(resp.hold, False)

    await asyncio.wait_for(resp.pipe(full_client), 10)
    assert b"".join(got) == b"".join(b"x" * 1024 + str(i).encode() for i in range(50))
    conn = resp._conn
    assert conn is not None and not conn._held and conn.reusable
    resp.release()
    resp = await pool.post("127.0.0.1", port, "/echo", {}, b"next")  # the same connection
    assert await asyncio.wait_for(resp.read(), 5) == b"next" and peers[-1] == peers[0]
    resp.release()
    pool.close()


async def test_an_engine_that_is_not_there_is_an_upstream_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(UpstreamError, match="cannot connect"):
        await Upstream().post("127.0.0.1", port, "/echo", {}, b"x")


def test_an_ipv6_engine_address_is_written_in_brackets() -> None:
    assert authority("10.244.1.7", 20001) == "10.244.1.7:20001"
    assert authority("fd00::7", 20001) == "[fd00::7]:20001"


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
async def test_an_engine_on_an_ipv6_pod_address_is_reached_with_a_valid_host_header() -> None:
    async def host(request: web.Request) -> web.Response:
        return web.Response(text=request.headers["Host"])

    app = web.Application()
    app.router.add_post("/echo", host)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "::1", 0)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        pytest.skip("no IPv6 loopback here")
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    pool = Upstream()
    try:
        resp = await pool.post("::1", port, "/echo", {}, b"x")
        assert resp.status == 200 and await resp.read() == f"[::1]:{port}".encode()
        resp.release()
    finally:
        pool.close()
        await runner.cleanup()


async def test_an_answer_the_door_holds_back_past_the_timeout_is_not_taken_for_a_stall(
        engine: tuple[int, list[str]]) -> None:
    port, _ = engine
    pool = Upstream(limit=4096, timeout=0.3)
    resp = await pool.post("127.0.0.1", port, "/stream", {}, b"2000")  # ~2 MB
    await asyncio.sleep(1.0)  # a slow reader: reading from the engine paused meanwhile
    assert len(await asyncio.wait_for(resp.read(), 10)) == sum(1024 + len(str(i))
                                                               for i in range(2000))
    resp.release()
    resp = await pool.post("127.0.0.1", port, "/stream", {}, b"200")
    got: list[bytes] = []

    def full_client(piece: bytes) -> None:  # full for a second after the first piece
        if not got:
            resp.hold(True)
            asyncio.get_running_loop().call_later(1.0, resp.hold, False)
        got.append(piece)

    await asyncio.wait_for(resp.pipe(full_client), 10)
    assert b"".join(got) == b"".join(b"x" * 1024 + str(i).encode() for i in range(200))
    resp.release()
    pool.close()


def test_an_answer_that_came_while_the_loop_was_blocked_is_read_before_the_clock_runs_out(
) -> None:
    uvloop = pytest.importorskip("uvloop")  # it runs timers before it reads: the case here
    asked, blocked = threading.Event(), threading.Event()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def engine() -> None:  # in its own thread: answers while the client's loop is blocked
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                asked.set()
                blocked.wait(5)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                conn.recv(1)  # until the client closes

        thread = threading.Thread(target=engine, daemon=True)
        thread.start()

        async def main() -> bytes:
            pool = Upstream(timeout=0.2)
            answer = asyncio.ensure_future(pool.post("127.0.0.1", port, "/", {}, b"{}"))
            while not asked.is_set():
                await asyncio.sleep(0.01)
            blocked.set()
            time.sleep(0.5)  # the loop blocked past the timeout; the answer came meanwhile
            resp = await answer
            try:
                return await resp.read()
            finally:
                resp.release()
                pool.close()

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            assert runner.run(main()) == b"ok"
        thread.join(5)


async def test_an_answer_read_whole_past_its_bound_is_an_error_and_its_connection_dropped(
        engine: tuple[int, list[str]]) -> None:
    port, peers = engine
    pool = Upstream()
    resp = await pool.post("127.0.0.1", port, "/stream", {}, b"2000")  # ~2 MB, no length
    with pytest.raises(UpstreamError, match="over 100000 bytes"):
        await resp.read(most=100_000)
    resp.release()
    resp = await pool.post("127.0.0.1", port, "/echo", {}, b"x" * 200)  # says its length
    with pytest.raises(UpstreamError, match="says it has 200 bytes"):
        await resp.read(most=100)
    resp.release()
    assert len(set(peers)) == 2 and not pool._idle.get(("127.0.0.1", port))
    pool.close()


async def test_one_read_of_many_chunks_is_one_piece_and_the_last_goes_with_the_end() -> None:
    """Each piece handed on is a write(2) to the client: an engine's read of five SSE chunks is
    handed on once, and the read that ends the answer goes with the end (strace counted 22
    writes a streamed answer against Envoy's 3 when every chunk was its own)."""
    events = [b"data: %d\n\n" % i for i in range(5)]
    chunks = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events)
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    go_on = asyncio.Event()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head + chunks)  # the head and five chunks in one write
        await writer.drain()
        await go_on.wait()
        writer.write(chunks + b"0\r\n\r\n")  # five more and the end in another
        await writer.drain()
        await reader.read()  # until the client closes
        writer.close()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Upstream()
    try:
        resp = await pool.post("127.0.0.1", port, "/stream", {}, b"")
        pieces: list[bytes] = []
        ends: list[bytes] = []

        def sink(piece: bytes) -> None:
            pieces.append(piece)
            go_on.set()

        await asyncio.wait_for(resp.pipe(sink, ends.append), 10)
        every = b"".join(events)
        assert pieces in ([every], [])  # the first read's five chunks: one piece
        assert b"".join(pieces + ends) == every * 2 and len(ends) == 1 and ends[0]
        resp.release()
    finally:
        pool.close()
        server.close()
        await server.wait_closed()
