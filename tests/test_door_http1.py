"""The door's own HTTP/1.1 server, against real clients (curl, aiohttp, the standard library's
``http.client``) and raw sockets: keep-alive, pipelining, bodies by length and by chunks, the
body limit, ``Expect: 100-continue``, upgrades, HEAD, HTTP/1.0, streams and their backpressure,
a client that leaves, a failing handler, idle connections and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from hypothesis import given, settings
from aiohttp import web
from hypothesis import strategies as st

from guard.conns import ConnLimits
from reconciler.door.http1 import (DOOR_LIMITS, KEEPALIVE_S, SHUTDOWN_S, Answer, Request,
                                     Server, Stream, json_answer)
from reconciler.door.proxy import Outcome, forward
from engine_http.upstream import Upstream

pytestmark = pytest.mark.timeout(30)

LIMIT = 1 << 16


def too_large() -> Answer:
    return Answer(413, b'{"error": "too large"}', {"Content-Type": "application/json"}, True)


async def echo(request: Request) -> Answer | Stream:
    """What the server made of the request, as JSON."""
    return json_answer({"method": request.method, "path": request.path, "query": request.query,
                        "body": request.body.decode(), "remote": request.remote,
                        "http11": request.http11,
                        "headers": {k: v for k, v in request.headers.items()
                                    if k in ("x-a", "content-type", "authorization")}})


async def served(handler: Callable[[Request], Awaitable[Answer | Stream]] = echo, *,
                 keepalive_s: float = KEEPALIVE_S, shutdown_s: float = SHUTDOWN_S,
                 limits: ConnLimits = DOOR_LIMITS) -> tuple[Server, int]:
    server = Server(handler, max_body=LIMIT, too_large=too_large, keepalive_s=keepalive_s,
                    shutdown_s=shutdown_s, limits=limits)
    return server, await server.start("127.0.0.1", 0)


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    server, port = await served()
    try:
        yield port
    finally:
        await server.stop()


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One answer off a raw connection: status line, headers, body (by Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return lines[0].encode(), headers, body


@contextlib.asynccontextmanager
async def connected(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A raw connection to the server, closed at the end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: door\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


# ---- real clients -------------------------------------------------------------------------


async def test_curl_gets_its_answer_and_a_large_body_goes_through_expect_continue(
        echo_port: int) -> None:
    body = "x" * 4096  # over 1 KiB: curl asks Expect: 100-continue and waits for the 100
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "-H", "Content-Type: application/json", "-H", "X-A: 1", "--data-binary",
        body, "-w", "\n%{http_code} %{time_total}", f"http://127.0.0.1:{echo_port}/p%20q?x=1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    text, _, trailer = out.decode().rpartition("\n")
    doc = json.loads(text)
    assert doc["body"] == body and doc["path"] == "/p q" and doc["query"] == "x=1"
    assert doc["headers"]["x-a"] == "1" and doc["remote"] == "127.0.0.1"
    code, seconds = trailer.split()
    assert code == "200"
    assert float(seconds) < 0.9  # curl gives up waiting for the 100 after 1 s


async def test_curl_http2_upgrade_is_answered_in_http11_on_the_same_connection(
        echo_port: int) -> None:
    url = f"http://127.0.0.1:{echo_port}/u"
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--http2", url, url, "-w", "\n%{http_version}\n",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    lines = [x for x in out.decode().splitlines() if x]
    assert [json.loads(x)["path"] for x in lines[0::2]] == ["/u", "/u"]
    assert lines[1::2] == ["1.1", "1.1"]


async def test_aiohttp_sends_a_chunked_body_and_reuses_its_connection(echo_port: int) -> None:
    async def pieces() -> AsyncIterator[bytes]:
        for piece in (b'{"a":', b' 1', b"}"):
            yield piece

    async with aiohttp.ClientSession() as http_session:
        url = f"http://127.0.0.1:{echo_port}/c"
        async with http_session.post(url, data=pieces()) as resp:
            assert resp.status == 200
            assert (await resp.json())["body"] == '{"a": 1}'
        for _ in range(3):
            async with http_session.get(url) as resp:
                assert resp.status == 200 and resp.headers["Date"].endswith("GMT")
        connector = http_session.connector
        assert connector is not None
        assert sum(len(v) for v in connector._conns.values()) == 1  # one kept-alive connection


async def test_the_standard_library_client_keeps_alive_and_heads(echo_port: int) -> None:
    await asyncio.to_thread(stdlib_client, echo_port)


def stdlib_client(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", "/one", body=b"1")
        first = conn.getresponse()
        assert first.status == 200 and json.loads(first.read())["body"] == "1"
        sock = conn.sock
        conn.request("HEAD", "/two")
        head = conn.getresponse()
        assert head.status == 200 and int(head.headers["Content-Length"]) > 0
        assert head.read() == b"" and conn.sock is sock  # the same connection, no body
        conn.request("GET", "/three")
        assert json.loads(conn.getresponse().read())["path"] == "/three"
    finally:
        conn.close()


# ---- raw sockets: framing -----------------------------------------------------------------


async def test_pipelined_requests_are_answered_in_order(echo_port: int) -> None:
    async with connected(echo_port) as (reader, writer):
        writer.write(b"".join(post(f"/{i}", str(i).encode()) for i in range(5)))
        for i in range(5):
            status, _, body = await read_answer(reader)
            assert status == b"HTTP/1.1 200 OK" and json.loads(body)["path"] == f"/{i}"


async def test_expect_continue_is_answered_before_the_body_is_sent(echo_port: int) -> None:
    async with connected(echo_port) as (reader, writer):
        writer.write(b"POST /e HTTP/1.1\r\nHost: d\r\nContent-Length: 3\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"abc")
        status, _, body = await read_answer(reader)
        assert status == b"HTTP/1.1 200 OK" and json.loads(body)["body"] == "abc"


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_a_body_over_the_limit_is_413_and_the_connection_closed(
        echo_port: int, framing: str) -> None:
    async with connected(echo_port) as (reader, writer):
        if framing == "length":  # refused at the head: the body is never sent
            writer.write(f"POST /b HTTP/1.1\r\nHost: d\r\nContent-Length: {LIMIT + 1}\r\n"
                         "Expect: 100-continue\r\n\r\n".encode())
        else:
            chunk = b"x" * 4096
            writer.write(b"POST /b HTTP/1.1\r\nHost: d\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + (b"1000\r\n" + chunk + b"\r\n") * (LIMIT // 4096 + 1))
        status, headers, body = await read_answer(reader)
        assert status.startswith(b"HTTP/1.1 413") and headers["connection"] == "close"
        assert json.loads(body) == {"error": "too large"}
        assert await reader.read() == b""  # closed


@pytest.mark.parametrize(("raw", "code"), [
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
    (b"POST /x HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
    (b"GET /x HTTP/1.1\r\nX-Big: " + b"y" * (70 << 10) + b"\r\n\r\n", 431),
])
async def test_a_malformed_request_is_refused_and_the_connection_closed(
        echo_port: int, raw: bytes, code: int) -> None:
    async with connected(echo_port) as (reader, writer):
        writer.write(raw)
        status, headers, body = await read_answer(reader)
        assert status.startswith(f"HTTP/1.1 {code}".encode())
        assert headers["connection"] == "close"
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        assert await reader.read() == b""


async def test_http10_answers_close_unless_asked_to_keep_alive(echo_port: int) -> None:
    async with connected(echo_port) as (reader, writer):
        writer.write(b"GET /k HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        _, headers, body = await read_answer(reader)
        assert headers["connection"] == "keep-alive" and not json.loads(body)["http11"]
        writer.write(b"GET /c HTTP/1.0\r\n\r\n")
        _, headers, _ = await read_answer(reader)
        assert headers["connection"] == "close" and await reader.read() == b""


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=12))
def test_requests_cut_anywhere_are_read_alike(cuts: list[int]) -> None:
    """However the bytes arrive (TCP may cut them anywhere), the same requests are read."""
    raw = (post("/a", b'{"x": 1}', "Content-Type: application/json\r\n")
           + b"POST /b HTTP/1.1\r\nHost: d\r\nTransfer-Encoding: chunked\r\n\r\n"
             b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
           + b"GET /c?q=1 HTTP/1.1\r\nHost: d\r\nX-A: 1\r\nX-A: 2\r\n\r\n")

    async def run() -> list[bytes]:
        server, port = await served()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.transport.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start = 0
            for cut in sorted({c for c in cuts if c < len(raw)}) + [len(raw)]:
                writer.write(raw[start:cut])
                await writer.drain()
                start = cut
            bodies = [(await read_answer(reader))[2] for _ in range(3)]
            writer.close()
            return bodies
        finally:
            await server.stop()

    docs = [json.loads(b) for b in asyncio.run(run())]
    assert [(d["path"], d["body"]) for d in docs] == [("/a", '{"x": 1}'), ("/b", "abcde"),
                                                      ("/c", "")]
    assert docs[0]["headers"]["content-type"] == "application/json"
    assert docs[2]["query"] == "q=1" and docs[2]["headers"]["x-a"] == "1, 2"


# ---- streams, disconnects, failures, idle and shutdown -------------------------------------


async def test_a_stream_arrives_piece_by_piece_chunked() -> None:
    step = asyncio.Event()

    async def streaming(request: Request) -> Stream:
        out = await request.stream(200, {"Content-Type": "text/event-stream"})
        await out.write(b"data: 1\n\n")
        await step.wait()  # the second piece only after the client has the first
        await out.write(b"data: 2\n\n")
        return out

    server, port = await served(streaming)
    try:
        async with aiohttp.ClientSession() as http_session, \
                http_session.post(f"http://127.0.0.1:{port}/s") as resp:
            assert resp.headers["Transfer-Encoding"] == "chunked"
            assert await resp.content.readuntil(b"\n\n") == b"data: 1\n\n"
            step.set()
            assert await resp.content.read() == b"data: 2\n\n"
    finally:
        await server.stop()


async def test_a_stream_to_an_http10_client_ends_with_the_connection() -> None:
    async def streaming(request: Request) -> Stream:
        out = await request.stream(200, {"Content-Type": "text/event-stream"})
        await out.write(b"data: 1\n\n")
        return out

    server, port = await served(streaming)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /s HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
        data = await reader.read(-1)  # to the end of the connection
        writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert b"Transfer-Encoding" not in head and b"Connection: close" in head
        assert body == b"data: 1\n\n"
    finally:
        await server.stop()


async def test_a_stream_waits_for_a_slow_reader() -> None:
    piece, pieces = b"z" * (1 << 20), 64
    written: list[int] = []

    async def streaming(request: Request) -> Stream:
        out = await request.stream(200, {"Content-Type": "application/octet-stream"})
        for i in range(pieces):
            await out.write(piece)
            written.append(i)
        return out

    server, port = await served(streaming)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
        writer.write(post("/s", b""))
        await reader.readuntil(b"\r\n\r\n")
        for _ in range(200):  # the server's writes pause: the client reads nothing meanwhile
            if any(c._writable is not None for c in server.connections):
                break
            await asyncio.sleep(0.01)
        assert any(c._writable is not None for c in server.connections)
        assert len(written) < pieces // 2  # held back, not buffered whole
        total = 0
        while total < pieces * len(piece):
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            total += len(await reader.readexactly(size + 2)) - 2
        assert len(written) == pieces and await reader.readuntil(b"\r\n\r\n") == b"0\r\n\r\n"
        writer.close()
    finally:
        await server.stop()


async def test_a_client_that_leaves_cancels_its_handler() -> None:
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def hanging(request: Request) -> Answer:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    server, port = await served(hanging)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/h", b"{}"))
        await asyncio.wait_for(entered.wait(), 5)
        writer.close()
        await asyncio.wait_for(cancelled.wait(), 5)
        assert server.connections == set()
    finally:
        await server.stop()


async def test_a_failing_handler_is_answered_500_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    async def failing(request: Request) -> Answer:
        raise RuntimeError("boom")

    server, port = await served(failing)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/f", b""))
        status, headers, body = await read_answer(reader)
        assert status.startswith(b"HTTP/1.1 500") and headers["connection"] == "close"
        assert json.loads(body)["error"]["type"] == "server_error" and b"boom" not in body
        assert "boom" in caplog.text
        writer.close()
    finally:
        await server.stop()


async def test_an_idle_connection_is_closed_and_a_busy_one_is_not() -> None:
    async def slow(request: Request) -> Answer:
        await asyncio.sleep(0.5)  # a handler longer than the idle time
        return Answer(200, b"done")

    server, port = await served(slow, keepalive_s=0.2)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/slow", b""))
        status, _, body = await read_answer(reader)
        assert status == b"HTTP/1.1 200 OK" and body == b"done"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # then idle: closed
        writer.close()
    finally:
        await server.stop()


async def test_stop_closes_idle_connections_and_cancels_what_outlives_the_grace() -> None:
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def hanging(request: Request) -> Answer:
        if request.path == "/quick":
            return Answer(200, b"ok")
        entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    server, port = await served(hanging, shutdown_s=0.2)
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
    idle_writer.write(post("/quick", b""))
    await read_answer(idle_reader)
    busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
    busy_writer.write(post("/hang", b""))
    await asyncio.wait_for(entered.wait(), 5)
    await server.stop()
    assert cancelled.is_set() and server.connections == set()
    assert await idle_reader.read() == b"" and await busy_reader.read() == b""
    idle_writer.close()
    busy_writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_a_slow_client_holds_back_the_engine_through_the_pipe() -> None:
    """Engine -> door (``proxy.forward``: the stream piped in the engine connection's callback)
    -> a client that does not read: the engine's own writes stop, and nothing is lost."""
    piece, pieces = b"e" * (1 << 20), 48
    sent: list[int] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(pieces):
            await resp.write(piece)  # waits while the door does not read
            sent.append(i)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    pool = Upstream()
    outcome = Outcome()

    async def door(request: Request) -> Answer | Stream:
        return await forward(request, pool, "127.0.0.1", engine_port, request.path, b"{}",
                             outcome)

    server, port = await served(door)
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
        writer.write(post("/v1/completions", b"{}"))
        await reader.readuntil(b"\r\n\r\n")
        for _ in range(300):  # the door's reading from the engine pauses
            if any(c.on_pressure is not None and c._writable is not None
                   for c in server.connections) and len(sent) > 1:
                break
            await asyncio.sleep(0.01)
        # Once the door stops reading, the kernel's socket buffers between the engine and the
        # door still take a piece or two; the engine is held once those are full.
        held_at, still = len(sent), 0
        for _ in range(300):
            await asyncio.sleep(0.01)
            held_at, still = len(sent), (still + 1 if len(sent) == held_at else 0)
            if still == 10:
                break
        for _ in range(20):
            await asyncio.sleep(0.01)  # the engine makes no more progress while held
        assert len(sent) == held_at < pieces // 2
        total = 0
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
            total += size
        assert total == pieces * len(piece) == outcome.bytes_out and len(sent) == pieces
    finally:
        if writer is not None:
            writer.close()
        await server.stop()
        pool.close()
        await runner.cleanup()


# ---- what a hostile or careless client sends ----------------------------------------------


async def test_an_upgrade_request_keeps_its_body_as_a_body(echo_port: int) -> None:
    """An ``Upgrade`` request's body is read as its body, never as a request of its own."""
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    async with connected(echo_port) as (reader, writer):
        writer.write(post("/outer", smuggled, "Connection: Upgrade\r\nUpgrade: h2c\r\n")
                     + b"GET /after HTTP/1.1\r\nHost: d\r\n\r\n")
        _, _, body = await read_answer(reader)
        assert json.loads(body)["path"] == "/outer"
        assert json.loads(body)["body"] == smuggled.decode()
        _, _, body = await read_answer(reader)
        assert json.loads(body)["path"] == "/after"  # the next request, not /smuggled
        many = post("/u", b"x", "Connection: Upgrade\r\nUpgrade: h2c\r\n") * 3000
        writer.write(many)  # one read with thousands of upgrades: no recursion
        for _ in range(3000):
            _, _, body = await read_answer(reader)
            assert json.loads(body)["body"] == "x"


async def test_curl_http2_upgrade_with_a_body_keeps_the_body(echo_port: int) -> None:
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--http2", "--data-binary", '{"model": "m"}',
        f"http://127.0.0.1:{echo_port}/v1/chat/completions",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    assert json.loads(out)["body"] == '{"model": "m"}'


async def test_a_client_that_does_not_read_does_not_grow_the_doors_buffers() -> None:
    """Pipelined requests whose answers are not read: the door stops answering (and reading)
    once the client's socket is full, instead of buffering every answer."""
    answered: list[int] = []
    big = b"a" * (100 << 10)

    async def large(request: Request) -> Answer:
        answered.append(1)
        return Answer(200, big)

    server, port = await served(large)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
        writer.write(b"GET /x HTTP/1.1\r\nHost: d\r\n\r\n" * 400)  # 40 MB of answers
        seen, still = -1, 0
        while still < 30:  # until the door has stopped answering for 0.3 s
            await asyncio.sleep(0.01)
            still = still + 1 if len(answered) == seen else 0
            seen = len(answered)
        conn = next(iter(server.connections))
        assert conn._writable is not None and conn.transport is not None
        assert len(answered) < 300 and conn.transport.get_write_buffer_size() < 1 << 20
        total = 0
        while total < 400 * len(big):  # read them all: the door goes on to the end
            total += len((await read_answer(reader))[2])
        assert len(answered) == 400
        writer.close()
    finally:
        await server.stop()


async def test_a_head_over_the_limit_is_431_even_when_it_comes_in_pieces(
        echo_port: int) -> None:
    async with connected(echo_port) as (reader, writer):
        writer.write(b"GET /" + b"a" * (40 << 10))
        await writer.drain()
        writer.write(b"b" * (40 << 10))  # the URL alone is over 64 KiB, never complete
        status, headers, _ = await read_answer(reader)
        assert status.startswith(b"HTTP/1.1 431") and headers["connection"] == "close"


async def test_chunked_trailers_are_not_headers(echo_port: int) -> None:
    async with connected(echo_port) as (reader, writer):
        writer.write(b"POST /t HTTP/1.1\r\nHost: d\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n0\r\nAuthorization: Bearer sneaky\r\n\r\n")
        _, _, body = await read_answer(reader)
        doc = json.loads(body)
        assert doc["body"] == "abc" and "authorization" not in doc["headers"]


async def test_a_refused_body_is_read_off_so_the_client_gets_the_413_not_a_reset(
        echo_port: int) -> None:
    sock = socket.create_connection(("127.0.0.1", echo_port))
    try:
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        head = f"POST /big HTTP/1.1\r\nHost: d\r\nContent-Length: {LIMIT * 8}\r\n\r\n"
        await loop.sock_sendall(sock, head.encode() + b"x" * (LIMIT * 8))  # no Expect
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += await loop.sock_recv(sock, 65536)
        assert answer.startswith(b"HTTP/1.1 413")
    finally:
        sock.close()


async def test_a_handler_that_loses_its_client_closes_the_connection() -> None:
    async def reset(request: Request) -> Answer:
        raise ConnectionResetError("the engine connection's peer went away")

    server, port = await served(reset)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/r", b""))
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await server.stop()


async def test_answers_during_shutdown_close_their_connections() -> None:
    release = asyncio.Event()

    async def waiting(request: Request) -> Answer:
        await release.wait()
        return Answer(200, b"late")

    server, port = await served(waiting, shutdown_s=5)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/w", b""))
        for _ in range(200):
            if any(c.busy for c in server.connections):
                break
            await asyncio.sleep(0.01)
        stopping = asyncio.create_task(server.stop())
        await asyncio.sleep(0)
        release.set()
        _, headers, body = await read_answer(reader)
        assert body == b"late" and headers["connection"] == "close"
        await stopping
        writer.close()
    finally:
        await server.stop()
