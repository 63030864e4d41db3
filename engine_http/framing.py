"""An engine's answer framed by llhttp: the parser of every byte an engine sends the door or the
agent.

An engine is a peer neither controls: a broken or hostile one must cost one request, never the
process (in the embedded mode the door's event loop is the agent's). So every byte it
sends is framed by llhttp (``httptools.HttpResponseParser``, strict, as uvicorn uses it), never
by hand: the hand-written parser this replaced looped forever on ``Content-Length: -5`` or a
chunk size of ``-5`` (``int()`` took the sign, and a step that took nothing ran again).

``ResponseParser`` is pure (bytes in, body pieces out), one a connection, and refuses with
``UpstreamError``: what does not begin ``HTTP/`` (llhttp also takes RTSP and ICE) or is not
HTTP/1.0 or 1.1 with a status of 100-599; a bad, signed, duplicated or overflowing
``Content-Length``, or one beside ``Transfer-Encoding``; a bad chunk size or chunk end; a header
name that is no RFC 9110 token, or a value with CR, LF, NUL or another control character (as
h11 and uvicorn refuse them); a protocol switch; a head over ``MAX_HEAD_BYTES``, and as much again
of trailers and of chunk lines past ``CHUNK_LINE_BYTES`` each (llhttp itself bounds none of
them). Interim 1xx answers are skipped, trailers are never taken for headers, an answer without
length runs until the connection closes (``eof``), and bytes after an answer spend the
connection (``spent``: the answer stands, the connection is not reused). What the door passes on
of the headers is its choice (``proxy.PASS_RESPONSE``: never a hop-by-hop one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, cast

import httptools

MAX_HEAD_BYTES = 64 << 10  # the status line and headers; trailers likewise
CHUNK_LINE_BYTES = 64  # a chunk's size line and CRLFs (a chunk extension is not ours to read)


class UpstreamError(Exception):
    """The engine could not be reached, or broke off its answer, or broke HTTP."""


class UpstreamTimeout(UpstreamError):
    """The engine sent nothing for the upstream timeout while it owed an answer."""


class UpstreamUnreachable(UpstreamError):
    """No connection to the engine could be made (refused, unreachable, connect timeout): the
    request was never sent, so it may be sent elsewhere (another replica of the claim)."""


class Head(NamedTuple):  # made once an answer: a tuple is the cheapest record
    status: int
    headers: Mapping[str, str]  # lower-case names (the first of repeated ones)
    keep_alive: bool
    length: int | None  # Content-Length, when the answer has one


class ResponseParser:
    """HTTP/1.1 answers' framing: ``feed`` bytes, get body pieces; the head, once in, is
    ``head``; ``done`` at its end; ``eof()`` when the connection closes; ``expect()`` before
    the next answer on a connection kept alive."""

    __slots__ = ("_parser", "_pieces", "_headers", "_codings", "_lead", "_fed", "_body",
                 "_allowance", "_head_bytes", "_until_close", "head", "done", "spent")

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.expect()

    def expect(self) -> None:
        """Ready for the next answer: on a connection whose last answer ended cleanly, llhttp
        reads on from where that one ended (one parser a connection, not one a request)."""
        self._pieces: list[bytes] = []
        self._headers: dict[str, str] = {}
        self._codings: list[str] = []  # Transfer-Encoding, every one given
        self._lead: bytes | None = b""  # the answer's first bytes, until they show "HTTP/"
        self._fed = 0  # bytes fed, and how many of them were body (the rest: the allowance)
        self._body = 0
        self._allowance = MAX_HEAD_BYTES
        self._head_bytes = 0  # the reason phrase and the header lines, as parsed
        self._until_close = False
        self.head: Head | None = None
        self.done = False
        self.spent = False  # bytes came after the answer: it stands, the connection does not

    def feed(self, data: bytes) -> list[bytes]:
        """Body pieces completed by ``data``; ``UpstreamError`` if it breaks HTTP (the pieces
        before the break are then ``taken()``)."""
        if self.done:
            self.spent = True
            return []
        if self._lead is not None:
            self._check_lead(data)  # once, mostly: the first read holds "HTTP/"
        self._fed += len(data)
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as err:
            if not self.done:
                if isinstance(err.__context__, UpstreamError):  # raised by a callback here
                    raise err.__context__ from None
                raise UpstreamError(f"the engine's answer is not valid HTTP: {err}") from None
            self.spent = True
        if self._fed - self._body > self._allowance:
            raise UpstreamError(f"the engine's answer has more than {MAX_HEAD_BYTES} bytes of "
                                "head or trailers, or overlong chunk lines")
        return self.taken()

    def taken(self) -> list[bytes]:
        """The body pieces decoded and not yet returned."""
        pieces, self._pieces = self._pieces, []
        return pieces

    def eof(self) -> None:
        """The connection closed: the end of an until-close body, else a broken answer."""
        if not self.done:
            if self.head is None or not self._until_close:
                raise UpstreamError("the engine closed the connection before the end of its "
                                    "answer")
            self.done = True

    def _check_lead(self, data: bytes) -> None:
        if not self._lead and data.startswith(b"HTTP/"):
            self._lead = None
            return
        lead = cast(bytes, self._lead) + data[:5]
        if not b"HTTP/".startswith(lead[:5]):
            raise UpstreamError(f"not an HTTP answer: {lead[:40]!r}")
        self._lead = None if len(lead) >= 5 else lead

    # ---- llhttp's callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.done:  # the next answer begins: nothing was asked for it
            raise UpstreamError("the engine sent bytes after its answer")

    def on_status(self, reason: bytes) -> None:
        self._head_bytes += len(reason)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head is not None:
            return  # a trailer: never taken for a header
        self._head_bytes += len(name) + len(value) + 4
        key = name.lower().decode("latin-1")
        text = value.rstrip().decode("latin-1")  # llhttp strips what leads
        if key == "transfer-encoding":
            self._codings.append(text)
        self._headers.setdefault(key, text)

    def on_headers_complete(self) -> None:
        if self._head_bytes > MAX_HEAD_BYTES:  # came whole in one read (else feed sees it)
            raise UpstreamError(f"the engine's answer has a head over {MAX_HEAD_BYTES} bytes")
        parser = self._parser
        version, status = parser.get_http_version(), parser.get_status_code()
        if version not in ("1.1", "1.0"):
            raise UpstreamError(f"the engine's answer is HTTP/{version}, not HTTP/1.x")
        if not 100 <= status <= 599:
            raise UpstreamError(f"the engine's answer has status {status}, not an HTTP status")
        headers, self._headers = self._headers, {}
        if status < 200:
            if status == 101:
                raise UpstreamError("the engine switched protocols")
            self._codings = []
            return  # interim (100 Continue): the real head follows
        length = headers.get("content-length")
        bodiless = status in (204, 304)
        chunked = bool(self._codings) \
            and ",".join(self._codings).rsplit(",", 1)[-1].strip().lower() == "chunked"
        self._until_close = not bodiless and length is None and not chunked
        self._allowance = 2 * MAX_HEAD_BYTES + 1024  # the head is in: trailers get as much
        self.head = Head(status, headers, parser.should_keep_alive(),
                         None if bodiless or length is None else int(length))

    def on_body(self, body: bytes) -> None:
        self._body += len(body)
        self._pieces.append(body)

    def on_chunk_header(self) -> None:
        self._allowance += CHUNK_LINE_BYTES

    def on_message_complete(self) -> None:
        if self.head is not None:  # not an interim answer's end
            self.done = True
