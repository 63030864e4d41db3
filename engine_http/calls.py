"""Whole calls to an engine over the pooled client: one request, its answer read whole with a
bound, all within one deadline. The agent's control calls (``engines.client``) and the door's
own asks (``/tokenize``, ``/v1/models``, Ollama's ``/api/ps`` and ``/api/tags``) are these.

An engine is a peer: whatever it sends, a call ends within ``timeout_s`` with a ``Reply`` or an
``UpstreamError``, never with another exception and never holding more than ``most`` bytes of
its answer:

- no answer in time (a stall before the head, mid-body, or an endless body trickled slowly) is
  ``UpstreamTimeout``; the deadline covers the connect, the head and the body;
- an answer that says, or turns out, to be longer than ``most`` is refused as soon as that is
  known (its connection closed, never pooled), not read to the deadline;
- an answer that breaks HTTP is framed by llhttp and refused (``engine_http.framing``).

A call on a pooled connection the engine closed (a restart on the same port) is retried once on
a new one (``Upstream.request``); ``post_json`` goes on a new connection unless told otherwise,
since a lifecycle call (sleep, wake, load an adapter) must never reach an engine twice.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import NamedTuple

from engine_http.framing import UpstreamError, UpstreamTimeout
from engine_http.upstream import Upstream
from guard import jsonbody

MAX_ANSWER = 16 << 20  # a control answer (a vLLM /metrics with many adapters is well under)
JSON_HEADERS: Mapping[str, str] = {"Content-Type": "application/json"}


class Reply(NamedTuple):
    status: int
    body: bytes


async def call(http: Upstream, method: str, host: str, port: int, path: str, timeout_s: float,
               body: bytes = b"", headers: Mapping[str, str] | None = None,
               most: int = MAX_ANSWER, fresh: bool = False) -> Reply:
    """``method path`` to the engine at ``host:port``, its whole answer within ``timeout_s``;
    ``UpstreamError`` (``UpstreamTimeout`` past the deadline) when there is none. ``fresh``: on
    a new connection (``Upstream.request``)."""
    try:
        async with asyncio.timeout(timeout_s):
            response = await http.request(method, host, port, path, headers or {}, body,
                                          fresh)
            try:
                return Reply(response.status, await response.read(most))
            finally:
                response.release()  # pooled when whole, else closed: the engine sees it
    except TimeoutError as err:
        raise UpstreamTimeout(f"{method} {path} got no whole answer within {timeout_s:g} s") \
            from err


async def get_json(http: Upstream, host: str, port: int, path: str, timeout_s: float,
                   most: int = MAX_ANSWER) -> object | None:
    """The JSON document of a 200 answer to ``GET path`` (its nesting bounded,
    ``guard.jsonbody``); None for any other answer, none in time, or one that is no JSON."""
    try:
        reply = await call(http, "GET", host, port, path, timeout_s, most=most)
        return jsonbody.loads(reply.body) if reply.status == 200 else None
    except (UpstreamError, ValueError):
        return None


async def post_json(http: Upstream, host: str, port: int, path: str, doc: object | None,
                    timeout_s: float, most: int = MAX_ANSWER, fresh: bool = True) -> Reply:
    """POST ``doc`` as JSON (None: an empty body), on a new connection unless ``fresh`` is
    False (a call that may reach the engine twice, as ``/tokenize``)."""
    body = b"" if doc is None else json.dumps(doc).encode()
    return await call(http, "POST", host, port, path, timeout_s, body,
                      JSON_HEADERS if doc is not None else None, most, fresh)


__all__ = ["MAX_ANSWER", "Reply", "UpstreamError", "UpstreamTimeout", "call", "get_json",
           "post_json"]
