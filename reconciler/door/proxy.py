"""Forwarding one request to an engine and its answer back, as the engine produces it.

The body goes out as the client sent it (the door only ever rewrites the ``model`` of an Ollama
request, whose server knows its model by the Ollama tag), over the door's own keep-alive
connections (``upstream``). The answer comes back untouched:

* a JSON answer is read whole and sent on with the engine's status and content type;
* a Server-Sent Event stream (``text/event-stream``), or Ollama's NDJSON stream
  (``application/x-ndjson``), is piped: each piece the engine sends is
  written to the client in the engine connection's own callback (``Response.pipe``), with no
  task switch between the two sockets. When the client's socket buffer fills, reading from the
  engine stops until it drains (backpressure: a slow reader slows the engine's stream instead of
  growing the door's memory). If the engine breaks off mid-stream (or breaks HTTP, or falls
  silent past the upstream timeout) the client gets an error event and ``[DONE]`` (vLLM's own
  shape for an error inside a stream), never a silent cut. A client that goes away cancels the
  handler (``reconciler.door.http1``), which closes the engine connection (an unfinished
  answer's connection is never reused), and the engine aborts the request;
* an engine that cannot be reached, or whose answer breaks HTTP before a stream has begun, is a
  502 in OpenAI's error shape (one silent for the upstream timeout, a 504), for that request
  alone: its connection is closed, never pooled.

Usage (``prompt_tokens``, ``completion_tokens``) is read from the answer's last ``"usage"``
object, found by searching the bytes (the answer is not parsed): the whole body of a JSON answer,
the last few kilobytes of a stream as the engine sent it (engines put usage in a final event, with
``stream_options.include_usage``, which the door asks for when the client did not, and then
takes out of what the client gets: ``reconciler.door.usage``), once the answer is sent
(``Outcome.usage_from``): nothing the door only counts stands between the engine's last byte
and the client.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from reconciler.door.errors import stream_error_event, upstream_failed, upstream_timed_out
from engine_http.framing import UpstreamError, UpstreamTimeout, UpstreamUnreachable
from reconciler.door.http1 import Answer, Request, Stream
from engine_http.upstream import Response, Upstream
from reconciler.door.usage import Hider

TAIL_BYTES = 4096
PASS_REQUEST = (("content-type", "Content-Type"), ("accept", "Accept"),
                ("accept-encoding", "Accept-Encoding"), ("x-request-id", "X-Request-Id"))
PASS_RESPONSE = ("Content-Type", "Content-Encoding", "Cache-Control", "X-Request-Id")
_USAGE = b'"usage"'
STREAMS = frozenset(("text/event-stream", "application/x-ndjson"))  # SSE; Ollama's native API
_OLLAMA_COUNTS = re.compile(rb'"prompt_eval_count":\s*(\d+)(?:.*?"eval_count":\s*(\d+))?')
_DECODER = json.JSONDecoder()


@dataclass
class Outcome:
    """What happened to one forwarded request (for metrics and the access log)."""

    status: int = 0
    stream: bool = False
    first_byte: float | None = None  # monotonic time of the first streamed byte
    usage_from: bytes = b""  # where usage is read from, after the answer is sent (usage_of)
    error: str | None = None  # a reason for the errors metric
    bytes_out: int = 0
    upstream_s: float | None = None  # sent to the engine -> its last byte passed on
    unreached: bool = False  # no connection could be made: the engine never saw the request


def usage_of(data: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) of the last ``"usage": {...}`` in ``data`` (the
    Responses API's ``input_tokens``, ``output_tokens`` too), else of Ollama's last
    ``prompt_eval_count`` and ``eval_count`` (its native API)."""
    found = _usage_object(data)
    if found is not None:
        return found
    counts = None
    for counts in _OLLAMA_COUNTS.finditer(data):
        pass
    if counts is None:
        return None
    return int(counts.group(1)), int(counts.group(2) or 0)


def _usage_object(data: bytes) -> tuple[int, int] | None:
    at = data.rfind(_USAGE)
    while at >= 0:
        start = data.find(b"{", at + len(_USAGE), at + len(_USAGE) + 8)
        if start >= 0:
            try:
                usage, _ = _DECODER.raw_decode(data[start:].decode("utf-8", "replace"))
            except ValueError:
                usage = None
            if isinstance(usage, dict):
                prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
                done = usage.get("completion_tokens", usage.get("output_tokens", 0))
                if isinstance(prompt, int) and isinstance(done, int):
                    return prompt, done
        at = data.rfind(_USAGE, 0, at)
    return None


def _request_headers(request: Request) -> dict[str, str]:
    out: dict[str, str] = {}
    given = request.headers
    for key, name in PASS_REQUEST:
        value = given.get(key)
        if value is not None:
            out[name] = value
    return out


def _response_headers(upstream: Response, extra: Mapping[str, str] | None = None
                      ) -> dict[str, str]:
    out: dict[str, str] = dict(extra) if extra else {}
    for name in PASS_RESPONSE:
        value = upstream.headers.get(name.lower())
        if value is not None:
            out[name] = value
    return out


async def forward(request: Request, upstream_pool: Upstream, host: str, port: int,
                  path: str, body: bytes, outcome: Outcome,
                  hide_usage: bool = False, extra: Mapping[str, str] | None = None
                  ) -> Answer | Stream:
    """Send ``body`` to the engine at ``host:port``; the answer for the client (a 502 when the
    engine did not answer). ``hide_usage``: the door asked for a stream's usage, the client
    did not (``reconciler.door.usage``); ``extra``: headers the door adds to the engine's
    answer (a route's attribution)."""
    sent = time.monotonic()
    try:
        upstream = await upstream_pool.post(host, port, path, _request_headers(request), body)
    except UpstreamTimeout as err:
        outcome.status, outcome.error = 504, "upstream_timeout"
        return upstream_timed_out(f"the model's engine did not answer: {err}")
    except UpstreamError as err:
        outcome.status, outcome.error = 502, "upstream_unreachable"
        outcome.unreached = isinstance(err, UpstreamUnreachable)
        return upstream_failed(f"the model's engine gave no usable answer: {err}")
    try:
        outcome.status = upstream.status
        if upstream.content_type in STREAMS:
            outcome.stream = True
            return await _stream(request, upstream, outcome, Hider() if hide_usage else None,
                                 extra)
        try:
            data = await upstream.read()
        except UpstreamTimeout as err:
            outcome.status, outcome.error = 504, "upstream_timeout"
            return upstream_timed_out(f"the model's engine stopped in its answer: {err}")
        except UpstreamError as err:
            outcome.status, outcome.error = 502, "upstream_broken"
            return upstream_failed(f"the model's engine broke off its answer: {err}")
    finally:
        upstream.release()
        outcome.upstream_s = time.monotonic() - sent
    if upstream.status >= 400:
        outcome.error = "upstream_error"
    else:
        outcome.usage_from = data
    outcome.bytes_out = len(data)
    return Answer(upstream.status, data, _response_headers(upstream, extra))


async def _stream(request: Request, upstream: Response, outcome: Outcome,
                  hider: Hider | None, extra: Mapping[str, str] | None) -> Stream:
    out = await request.stream(upstream.status, _response_headers(upstream, extra))
    tail = b""

    def seen(chunk: bytes) -> None:  # the engine's bytes, usage included: what is counted
        nonlocal tail
        if outcome.first_byte is None:
            outcome.first_byte = time.monotonic()
        tail = (tail + chunk)[-TAIL_BYTES:]

    def passed(chunk: bytes) -> None:  # in the engine connection's callback: no task switch
        seen(chunk)
        if hider is not None:
            chunk = hider.piece(chunk)
        outcome.bytes_out += len(chunk)
        out.send(chunk)

    def ended(last: bytes) -> None:  # the last bytes and the end of the answer: one write
        if last:
            seen(last)
        if hider is not None:
            last = hider.last(last)
        outcome.bytes_out += len(last)
        out.finish(last)

    out.pressure(upstream.hold)  # a full client socket stops the reading from the engine
    try:
        try:
            await upstream.pipe(passed, ended)  # the stream's end written as it comes
        except UpstreamError as err:
            outcome.error = "upstream_timeout" if isinstance(err, UpstreamTimeout) \
                else "upstream_broken"
            if hider is not None:
                hider.drop()
            await out.write(stream_error_event(f"the model's engine broke off the stream: {err}"))
        await out.end()
    except ConnectionResetError:  # the client went away while we wrote
        outcome.error = "client_disconnected"
        return out
    finally:
        out.pressure(None)
    outcome.usage_from = tail
    return out
