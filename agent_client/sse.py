"""Reading a Server-Sent Events stream (the agent's ``events/stream``) from an aiohttp body.

No maintained SSE client fits: ``aiohttp-sse-client2`` had its last release in February 2023,
``httpx-sse`` needs httpx, and ``sseclient-py`` is synchronous. So aiohttp does the byte work
(``StreamReader.readline``, which bounds a line) and this module only interprets lines, by the
WHATWG rules ("interpreting an event stream"), each rule with the bug it prevents:

- A line ends with LF, CRLF or a lone CR. (Splitting on LF alone turns ``data: a\\rdata: b``
  into one field, and a CRLF stream into values that end in ``\\r``.) aiohttp hands over a line
  when it sees LF, so a stream of lone CRs is read when a LF or the end comes; ours sends LF.
- A blank line dispatches the event being built; an event without ``data`` is not dispatched
  and its ``event`` name does not leak into the next one.
- The last event id persists until another ``id`` line changes it, and an id with a NUL is
  ignored: the id is what a reconnect sends as ``Last-Event-ID``, a header a NUL would break.
- A byte that is not UTF-8 becomes U+FFFD (a stray byte never ends the stream), and one leading
  byte-order mark is dropped.
- An event that never ends is bounded: a line over ``max_line_bytes`` or an event over
  ``max_event_chars`` is an ``SSEError``, never unbounded memory.
- Text after the last blank line (a stream cut in the middle of an event) is not an event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NamedTuple

import aiohttp
from aiohttp.http_exceptions import LineTooLong

MAX_LINE_BYTES = 1 << 16
MAX_EVENT_CHARS = 1 << 20


class SSEError(ValueError):
    """The stream broke a bound (a line or an event too long)."""


class ServerEvent(NamedTuple):
    """One dispatched event: its type (``message`` unless named), its data, the last id."""

    event: str
    data: str
    id: str | None


class SSEDecoder:
    """Complete lines in, events out; keeps the event being built and the last id."""

    def __init__(self, max_event_chars: int = MAX_EVENT_CHARS) -> None:
        self._max = max_event_chars
        self._event = ""
        self._data: list[str] = []
        self._size = 0
        self.last_id: str | None = None

    def line(self, text: str) -> ServerEvent | None:
        """Interpret one line (without its terminator); the event it dispatches, if any."""
        if not text:
            return self._dispatch()
        if text.startswith(":"):
            return None
        name, colon, value = text.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._size += len(value) + 1
            if self._size > self._max:
                raise SSEError(f"an event of the stream is over {self._max} characters")
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self.last_id = value
        return None

    def _dispatch(self) -> ServerEvent | None:
        event, data = self._event or "message", self._data
        self._event, self._data, self._size = "", [], 0
        return ServerEvent(event, "\n".join(data), self.last_id) if data else None


def split_lines(text: str, complete: bool) -> list[str]:
    """The lines of one chunk that aiohttp ended at a LF (``complete``) or at the end of the
    body; in the latter, what follows the last CR has no terminator yet and is dropped."""
    if complete:
        body = text[:-1]
        return (body[:-1] if body.endswith("\r") else body).split("\r")
    return text.split("\r")[:-1]


async def read_events(content: aiohttp.StreamReader, *, max_line_bytes: int = MAX_LINE_BYTES,
                      max_event_chars: int = MAX_EVENT_CHARS) -> AsyncIterator[ServerEvent]:
    """Each event of a response body, until the body ends; ``SSEError`` past a bound."""
    decoder = SSEDecoder(max_event_chars)
    first = True
    while True:
        try:
            raw = await content.readline(max_line_length=max_line_bytes)
        except LineTooLong:
            raise SSEError(f"a line of the stream is over {max_line_bytes} bytes") from None
        if not raw:
            return
        text = raw.decode("utf-8", errors="replace")
        if first:
            text, first = text.removeprefix("\ufeff"), False
        for line in split_lines(text, text.endswith("\n")):
            event = decoder.line(line)
            if event is not None:
                yield event
