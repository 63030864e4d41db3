"""Hostile engine answers against the door's response framing (llhttp), as properties: valid
answers (a JSON one by length, an SSE stream in chunks) mutated in every length, chunk size,
header, status line and cut, and split at arbitrary points. Each either yields the body its
framing declares or a clean ``UpstreamError``, the same however the bytes arrive and whether or
not the parser read an answer before (one parser a kept-alive connection), never another
exception and never a hang (the hand-written parser this replaced looped forever on a negative
length; the module's timeout fails such a test). Then the same through real sockets: the door's
client returns the body or an ``UpstreamError`` within a bounded time, and never pools a
connection that carried a broken answer."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine_http.framing import MAX_HEAD_BYTES, ResponseParser, UpstreamError, UpstreamTimeout
from engine_http.upstream import Upstream

pytestmark = pytest.mark.timeout(120)

BODY = b'{"id":"cmpl-1","object":"chat.completion","choices":[{"text":"hello"}]}'
EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]
TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
FRAMING = {b"content-length", b"transfer-encoding", b"connection", b"upgrade", b"keep-alive",
           b"proxy-connection", b"trailer", b"te"}
CUTS = st.lists(st.integers(0, 4096), max_size=6)


def json_answer(length: bytes | None = None, header: bytes | None = None,
                status: bytes = b"HTTP/1.1 200 OK") -> bytes:
    lines = [status, *([header] if header is not None else []),
             b"content-type: application/json",
             b"content-length: " + (str(len(BODY)).encode() if length is None else length)]
    return b"\r\n".join(lines) + b"\r\n\r\n" + BODY


def sse_answer(sizes: dict[int, bytes] | None = None, trailer: bytes = b"") -> bytes:
    """The stream; ``sizes``: a chunk's size line replaced (the last chunk is index 4)."""
    out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
           b"\r\n\r\n"]
    for i, event in enumerate(EVENTS + [b""]):
        size = (sizes or {}).get(i, b"%x" % len(event))
        out.append(size + b"\r\n" + event + (b"\r\n" if event else b""))
    out.append(trailer + b"\r\n")
    return b"".join(out)


def framed(raw: bytes, cuts: Sequence[int] = (), kept: bool = False) -> tuple[str, bytes]:
    """("ok", body) or ("error", b""): ``raw`` fed in pieces cut at ``cuts``, then its end;
    ``kept``: to a parser that read a whole answer before (a connection kept alive)."""
    parser = ResponseParser()
    if kept:
        assert parser.feed(json_answer()) == [BODY] and parser.done and not parser.spent
        parser.expect()
    body: list[bytes] = []
    bounds = sorted({c for c in cuts if 0 < c < len(raw)}) + [len(raw)]
    start = 0
    try:
        for end in bounds:
            body += parser.feed(raw[start:end])
            start = end
        parser.eof()
    except UpstreamError:
        return "error", b""
    assert parser.done and parser.head is not None
    for name, value in parser.head.headers.items():  # only clean headers ever come out
        assert TOKEN.fullmatch(name.encode("latin-1")), name
        assert not CONTROL.search(value.encode("latin-1")), value
    return "ok", b"".join(body)


def alike(raw: bytes, cuts: Sequence[int]) -> tuple[str, bytes]:
    """``framed``, checked to be the same whole, in pieces, and after another answer."""
    whole = framed(raw)
    assert framed(raw, cuts) == whole == framed(raw, cuts, kept=True)
    return whole


@given(CUTS)
def test_valid_answers_are_read_whole_however_the_bytes_arrive(cuts: list[int]) -> None:
    assert alike(json_answer(), cuts) == ("ok", BODY)
    assert alike(sse_answer(), cuts) == ("ok", b"".join(EVENTS))
    trailed = sse_answer({1: b"%x;ext=1" % len(EVENTS[1])}, trailer=b"x-trailer: t\r\n")
    assert alike(trailed, cuts) == ("ok", b"".join(EVENTS))


LENGTHS = st.one_of(
    st.integers(-(10 ** 30), 10 ** 30).map(lambda n: str(n).encode()),
    st.sampled_from([b"", b" ", b"+5", b"0x10", b"1e3", b"5, 5", b"5 5", b"\xd9\xa3",
                     b"18446744073709551615", b"18446744073709551616", b"00000000000000005",
                     b"-0", b"nan"]),
    st.binary(max_size=24))


@given(LENGTHS, CUTS)
@example(b"-5", [])
def test_a_content_length_is_its_digits_or_the_answer_is_refused(length: bytes,
                                                                 cuts: list[int]) -> None:
    outcome = alike(json_answer(length), cuts)
    if b"\r" in length or b"\n" in length:
        return  # another line, or the head's end: framing that is checked elsewhere
    if length.isdigit() and int(length) < 1 << 64:
        n = int(length)
        # shorter: the answer ends there (the rest spends the connection); longer: cut short
        assert outcome == (("ok", BODY[:n]) if n <= len(BODY) else ("error", b""))
    else:
        assert outcome == ("error", b"")


SIZES = st.one_of(
    st.integers(-(1 << 70), 1 << 70).map(lambda n: (b"-" if n < 0 else b"") + b"%x" % abs(n)),
    st.sampled_from([b"", b" 5", b"5 ", b"+5", b"0x5", b"zz", b"5\x00", b"ffffffffffffffffff"]),
    st.binary(max_size=12))


@given(st.integers(0, len(EVENTS)), SIZES, CUTS)
@example(1, b"-5", [])
def test_a_chunk_size_that_is_no_hex_number_is_refused(index: int, size: bytes,
                                                       cuts: list[int]) -> None:
    outcome = alike(sse_answer({index: size}), cuts)
    actual = len((EVENTS + [b""])[index])
    if re.fullmatch(rb"[0-9a-fA-F]{1,16}", size) and int(size, 16) == actual:
        assert outcome == ("ok", b"".join(EVENTS))
    elif not re.fullmatch(rb"[0-9a-fA-F]+(;.*)?", size, re.DOTALL):
        assert outcome == ("error", b"")
    # another size misframes the rest: refused or read as framed, and never a hang; a size
    # with a chunk extension (``5;name=value``, RFC 9112 7.1.1) is a legal size line, which
    # llhttp reads or refuses by the extension's bytes (test below)


def test_a_chunk_extension_after_the_right_size_is_legal_and_one_without_a_name_is_not(
        ) -> None:
    # hypothesis found the oracle above wrong here: `10;a` had been taken for no hex number
    for index in range(len(EVENTS) + 1):
        actual = b"%x" % len((EVENTS + [b""])[index])
        for ext in (b";a", b";name=value", b';n="q"'):
            assert alike(sse_answer({index: actual + ext}), []) == ("ok", b"".join(EVENTS))
        assert alike(sse_answer({index: actual + b";"}), []) == ("error", b"")


HEADER_BYTES = st.binary(max_size=16) | st.text(max_size=12).map(str.encode)


@given(HEADER_BYTES, HEADER_BYTES, CUTS)
@example(b"Bad Name", b"x", [])
@example(b"X-A", b"a\x00b", [])
@example(b"X-A", b"a\rb", [])
@example(b"", b"x", [])
@example(b"*:", b"", [])
def test_a_header_line_is_taken_only_with_a_token_name_and_a_clean_value(
        name: bytes, value: bytes, cuts: list[int]) -> None:
    outcome = alike(json_answer(header=name + b": " + value), cuts)
    # The name ends at the line's first colon ('*:' sent as a name is the name '*').
    name, _, rest = (name + b": " + value).partition(b":")
    value = rest.strip(b" \t")
    if b"\r" in name + value or b"\n" in name + value or name.lower() in FRAMING:
        return  # another line (a CR LF in the name can end the head), or other framing
    if TOKEN.fullmatch(name) and not CONTROL.search(value):
        assert outcome == ("ok", BODY)
    else:
        assert outcome == ("error", b"")


STATUS_LINES = st.sampled_from([
    b"HTTP/1.0 200 OK", b"HTTP/1.1 503 Service Unavailable", b"HTTP/1.1 200", b"HTTP/2 200",
    b"HTTP/2.0 200 OK", b"HTTP/1.2 200 OK", b"HTTP/0.9 200 OK", b"RTSP/1.0 200 OK",
    b"ICE/1.0 200 OK", b"HTTP/1.1 42 Odd", b"HTTP/1.1 999 Odd", b"HTTP/1.1 600 Odd",
    b"HTTP/1.1 -20 Odd", b"HTTP/1.1 0200 OK", b"http/1.1 200 OK", b"HTTP/1.1  200 OK", b"",
    b"SSH-2.0-OpenSSH_9.6", b"HTTP/1.1 101 Switching Protocols"]) | st.binary(max_size=24)


@given(STATUS_LINES, CUTS)
def test_only_an_http1_status_line_with_an_http_status_is_taken(line: bytes,
                                                                cuts: list[int]) -> None:
    outcome = alike(json_answer(status=line), cuts)
    clean = re.fullmatch(rb"HTTP/1\.[01] ([0-9]{3})( [\t !-~]*)?", line)
    if clean and 200 <= int(clean[1]) <= 599 and int(clean[1]) not in (204, 304):
        assert outcome == ("ok", BODY)
    elif clean and not 200 <= int(clean[1]) <= 599 or not re.match(rb"HTTP/1\.[01] ", line):
        assert outcome == ("error", b"")  # 1xx: the body is read as the next answer's head


@given(st.integers(0, 10_000), st.booleans())
def test_an_answer_cut_short_is_refused_at_the_close(cut: int, stream: bool) -> None:
    raw = sse_answer() if stream else json_answer()
    assert framed(raw[:cut % len(raw)]) == ("error", b"")


@given(st.binary(min_size=1, max_size=64), CUTS)
@example(b"\n", [])
@example(b"\r\nx", [])
def test_bytes_after_an_answer_spend_the_connection_but_the_answer_stands(
        junk: bytes, cuts: list[int]) -> None:
    for raw, body in ((json_answer(), BODY), (sse_answer(), b"".join(EVENTS))):
        assert alike(raw + junk, cuts) == ("ok", body)
        parser = ResponseParser()
        parser.feed(raw + junk)
        # llhttp skips empty lines between answers (RFC 9112 2.2): those alone spend nothing
        assert parser.done and (parser.spent or not junk.strip(b"\r\n"))


@given(st.binary(max_size=512), CUTS)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_any_bytes_at_all_are_framed_or_refused(data: bytes, cuts: list[int]) -> None:
    alike(data, cuts)
    alike(b"HTTP/1.1 200 OK\r\n" + data, cuts)
    alike(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + data, cuts)


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 " + b"x" * MAX_HEAD_BYTES + b"\r\ncontent-length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"x-pad: %b\r\n" % (b"p" * 1000) * 70 + b"content-length: 0\r\n\r\n",
    sse_answer(trailer=b"x-trailer: " + b"t" * (3 * MAX_HEAD_BYTES) + b"\r\n"),
    sse_answer({2: b"e;" + b"x" * (3 * MAX_HEAD_BYTES)}),
])
def test_a_head_trailer_or_chunk_line_without_end_is_refused(raw: bytes) -> None:
    assert framed(raw) == framed(raw, range(0, len(raw), 1000)) == ("error", b"")


# ---- through real sockets -----------------------------------------------------------------


async def _exchange(answer: bytes, then: str, stream: bool) -> tuple[str, bytes, int]:
    """One request to a raw server that answers ``answer`` (then closes, or stays silent);
    what the door's client made of it, and how many connections it pooled."""

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            writer.write(answer)
            await writer.drain()
            if then == "close":
                writer.close()
            else:
                await reader.read()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Upstream(timeout=0.3)
    try:
        async with asyncio.timeout(5):  # never a hang: the stall timer answers within it
            try:
                resp = await pool.post("127.0.0.1", port, "/", {}, b"{}")
                try:
                    if stream:
                        got: list[bytes] = []
                        await resp.pipe(got.append)
                        body = b"".join(got)
                    else:
                        body = await resp.read()
                finally:
                    resp.release()
            except UpstreamTimeout:
                return "timeout", b"", len(pool._idle.get(("127.0.0.1", port), []))
            except UpstreamError:
                return "error", b"", len(pool._idle.get(("127.0.0.1", port), []))
        return "ok", body, len(pool._idle.get(("127.0.0.1", port), []))
    finally:
        pool.close()
        server.close()
        await server.wait_closed()


@given(st.one_of(LENGTHS.map(json_answer),
                 st.tuples(st.integers(0, len(EVENTS)), SIZES).map(
                     lambda t: sse_answer({t[0]: t[1]})),
                 st.tuples(HEADER_BYTES, HEADER_BYTES).map(
                     lambda t: json_answer(header=t[0] + b": " + t[1]))),
       st.integers(0, 10_000), st.sampled_from(["close", "stall"]), st.booleans())
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
def test_the_client_returns_the_body_or_an_error_in_bounded_time_and_pools_only_clean_ones(
        answer: bytes, cut: int, then: str, stream: bool) -> None:
    raw = answer[:cut] if cut < len(answer) else answer
    kind, body, pooled = asyncio.run(_exchange(raw, then, stream))
    expected = framed(raw)
    if kind == "ok":
        assert (kind, body) == expected
    else:  # an answer framed whole may still break as the connection ends; never pooled
        assert pooled == 0
        assert kind == "error" or then == "stall"
    if expected[0] == "error" and then == "close":
        assert kind == "error"
