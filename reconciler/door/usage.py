"""Token counts for streamed answers: the door asks the engine, and hides what it asked for.

An engine says how many tokens a streamed request took only when the request asks
(``stream_options.include_usage``): vLLM, SGLang and Ollama's OpenAI routes then send one more
event before ``data: [DONE]``, with ``"choices": []`` and the ``usage`` object. Most clients do
not ask, so ``aibrix:door_tokens_total`` and the access log would count no streamed token.

The door asks on the client's behalf (``ask``), so every stream is counted with the engine's
own figures, and takes back out of the stream what the client did not ask for (``Hider``):
that usage-only event, and the zero ``usage`` Ollama adds to each ``/v1/completions`` chunk
while usage is asked. The client gets the events it would have got without the door; the
counting still reads the engine's bytes (``reconciler.door.proxy``).

A stream's pieces pass through ``Hider`` in the engine connection's callback, so each piece
costs two byte searches (the last event boundary, and ``"usage"``), never a JSON parse; only an
event that names ``usage`` is looked into. A piece that ends inside an event keeps that
event's start until its end arrives (a client cannot use half an event), and a stream that
never ends an event within ``MAX_HELD`` bytes is passed on untouched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

STREAMING = ("chat", "completion")  # the endpoints (labels of reconciler.door.server)
_ASK = b',"stream_options":{"include_usage":true}}'
_USAGE = b'"usage"'
_CHOICES = b'"choices"'
_END = b"\n\n"
_SPACE = b" \t\r\n"
MAX_HELD = 1 << 20


def _options(endpoint: str, doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``stream_options`` that ask for usage, when the client streams without asking for
    it (None: the client's stand). ``continuous_usage_stats`` (vLLM, SGLang: usage on every
    chunk) is dropped, since without ``include_usage`` it asked for nothing."""
    if endpoint not in STREAMING or doc.get("stream") is not True:
        return None
    options = doc.get("stream_options")
    if options is None:
        return {"include_usage": True}
    if not isinstance(options, dict) or options.get("include_usage") not in (None, False):
        return None  # asked already, or a value the engine should judge
    kept = {k: v for k, v in options.items() if k != "continuous_usage_stats"}
    return {**kept, "include_usage": True}


def upstream_body(endpoint: str, doc: Mapping[str, Any], body: bytes,
                  model: str) -> tuple[bytes, bool]:
    """The body for the engine, which knows the model as ``model``, and whether it asks for
    usage the client did not ask for (then ``Hider`` takes it out of the answer)."""
    options = _options(endpoint, doc)
    renamed = model != doc.get("model")
    if options is None:
        return (json.dumps({**doc, "model": model}).encode() if renamed else body), False
    if not renamed and "stream_options" not in doc:  # the usual case: a splice, no encoding
        end = body.rstrip(_SPACE)
        if end.endswith(b"}"):
            return end[:-1] + _ASK, True
    return json.dumps({**doc, "model": model, "stream_options": options}).encode(), True


def _value(data: bytes, at: int) -> int:
    """Where the value of the key ending at ``at`` starts (past the colon and spaces)."""
    n = len(data)
    while at < n and data[at] in _SPACE:
        at += 1
    if at < n and data[at] == 0x3A:  # ':'
        at += 1
    while at < n and data[at] in _SPACE:
        at += 1
    return at


def _no_choices(event: bytes) -> bool:
    at = event.find(_CHOICES)
    if at < 0:
        return False
    start = _value(event, at + len(_CHOICES))
    if event[start:start + 1] != b"[":
        return False
    close = _value(event, start + 1)
    return event[close:close + 1] == b"]"


def _strip(events: bytes) -> bytes:
    """``events`` (whole ones) without the usage the client did not ask for."""
    out: list[bytes] = []
    done = 0
    at = events.find(_USAGE)
    while at >= 0:
        start = _value(events, at + len(_USAGE))
        if events[start:start + 1] == b"{":
            begin = events.rfind(_END, 0, at)
            begin = 0 if begin < 0 else begin + len(_END)
            stop = events.find(_END, at)
            stop = len(events) if stop < 0 else stop + len(_END)
            if _no_choices(events[begin:stop]):  # the usage-only event: all of it goes
                out.append(events[done:begin])
                done = stop
            else:  # a usage on a chunk with choices (Ollama's zeros): the member goes
                close = events.find(b"}", start)
                comma = events.rfind(b",", done, at)
                if close > 0 and b"{" not in events[start + 1:close] and comma >= 0 \
                        and not events[comma + 1:at].strip(_SPACE):
                    out.append(events[done:comma])
                    done = close + 1
            at = events.find(_USAGE, max(done, start))
        else:
            at = events.find(_USAGE, start)
    if not done:
        return events
    out.append(events[done:])
    return b"".join(out)


class Hider:
    """One stream's filter: ``piece`` for each piece from the engine, ``last`` for the bytes
    that end it; each answers the bytes the client may see now."""

    def __init__(self) -> None:
        self._held = b""
        self._off = False  # not a stream of events as engines send them: pass everything

    def piece(self, chunk: bytes) -> bytes:
        if self._off:
            return chunk
        data = self._held + chunk if self._held else chunk
        end = data.rfind(_END)
        if end < 0:
            if len(data) > MAX_HELD:
                self._off, self._held = True, b""
                return data
            self._held = data
            return b""
        end += len(_END)
        if end < len(data):
            data, self._held = data[:end], data[end:]
        else:
            self._held = b""
        return _strip(data) if data.find(_USAGE) >= 0 else data

    def last(self, chunk: bytes) -> bytes:
        out = self.piece(chunk)
        rest, self._held = self._held, b""
        return out + rest

    def drop(self) -> None:
        """The stream broke off: half an event is never sent (an error event follows)."""
        self._held = b""
