"""JSON over aiohttp to one base URL, and what an answer is: the layer under the agent client.

``JsonApi`` makes one call and returns one ``Reply``. A refusal is data, not an exception:
every call returns a ``Reply`` (HTTP status and JSON body, with the server's ``reason`` such as
``InsufficientGPUMemory``), so a caller can record it and decide. Only a server that cannot be
reached (connection refused, timeout) raises ``AgentUnreachable``; one that answers with a body
that is not a JSON object raises its kind ``NotTheApi`` (another service at that address).

Tokens: with a ``token`` (a command line's, from ``client_token``), every call carries
``Authorization: Bearer <token>``; a long-lived session instead carries ``bearer_middleware``,
which sends the token as it is now (a rotated Secret is re-read by ``guard.tokens``) on every
call, feeds included. The reconciler's command line uses ``JsonApi`` for its own API too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import ClientHandlerType, ClientRequest, ClientResponse
from aiohttp.client_middlewares import ClientMiddlewareType

from guard.tokens import TokenSource, token_source

TOKEN_ENV = "RUNTIME_AGENT_TOKEN"  # the token itself; ``--token-file`` names a file instead


class AgentUnreachable(Exception):
    """The agent did not answer (or answered something that is not its API)."""


class NotTheApi(AgentUnreachable):
    """Something answered, but not with a JSON object: another service at that address.
    ``status`` and the start of the body say what answered."""

    def __init__(self, message: str, status: int = 0, text: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.text = text


class FeedError(AgentUnreachable):
    """The events feed answered something that is not an events page."""


class Refusal(Exception):
    """An answer that is not a success (4xx, 5xx), for callers that stop at the first one."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.message)
        self.reply = reply


def ok_body(reply: Reply) -> Mapping[str, Any]:
    """The body of a successful reply; ``Refusal`` otherwise."""
    if not reply.ok:
        raise Refusal(reply)
    return reply.body


@dataclass(frozen=True)
class Reply:
    """One answer of the agent's control API."""

    status: int
    body: Mapping[str, Any] = field(default_factory=dict)
    etag: str | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def reason(self) -> str | None:
        """The agent's reason for a refusal (``InsufficientGPUMemory``, ...), if it gave one."""
        value = self.body.get("reason")
        return value if isinstance(value, str) else None

    @property
    def message(self) -> str:
        value = self.body.get("message")
        return value if isinstance(value, str) else f"HTTP {self.status}"

    @property
    def in_force(self) -> bool:
        """For sleep, wake and kv-limit: the agent confirms the asked state holds now.

        ``applied`` (the AIBrix sidecar's field) says only whether this call changed
        anything; an agent without ``in_force`` is read by ``applied``."""
        value = self.body.get("in_force", self.body.get("applied"))
        return self.ok and bool(value)


def client_token(token_file: str | None, environ: Mapping[str, str]) -> TokenSource | None:
    """A client's token: ``token_file`` (re-read when it changes) or ``RUNTIME_AGENT_TOKEN``
    in ``environ``, by ``guard.tokens``' one rule; None when neither. ``TokenError`` (one
    line to print) when the file cannot be used."""
    return token_source(token_file, environ.get(TOKEN_ENV))


def bearer_middleware(source: TokenSource | None) -> tuple[ClientMiddlewareType, ...]:
    """Client middlewares that put ``source``'s current token on every request (none
    without a source)."""
    if source is None:
        return ()

    async def bearer(request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        token = source.token()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        return await handler(request)

    return (bearer,)


class JsonApi:
    """JSON over HTTP to one base ``url``. ``session``: shared by every client (one pool of
    connections); ``timeout_s``: per call, unless a call names its own."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, timeout_s: float = 10.0,
                 token: str | None = None) -> None:
        self._url = url.rstrip("/")
        self._session = session
        self._timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    @property
    def url(self) -> str:
        return self._url

    async def request(self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
                      timeout_s: float | None = None,
                      headers: Mapping[str, str] | None = None) -> Reply:
        """One call; any answer is a ``Reply``. Raises ``AgentUnreachable`` when nothing
        answers in time and ``NotTheApi`` when the body is not a JSON object."""
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        return await self._call(method, path, None if body is None else dict(body), timeout,
                                headers)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None,
                    timeout: aiohttp.ClientTimeout,
                    headers: Mapping[str, str] | None = None) -> Reply:
        sent = {**self._headers, **headers} if headers else self._headers
        try:
            async with self._session.request(method, self._url + path, json=body,
                                             timeout=timeout, headers=sent) as resp:
                raw = await resp.read()
                status = resp.status
                etag = resp.headers.get("ETag")
        except (TimeoutError, aiohttp.ClientError, OSError) as err:
            raise AgentUnreachable(f"{self._url}{path}: {str(err) or type(err).__name__}"
                                   ) from None
        if status == 304:
            return Reply(304, {}, etag)
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            raise NotTheApi(f"{self._url}{path}: answered {status} with a body that is not "
                            "JSON", status, _start(raw)) from None
        if not isinstance(payload, dict):
            raise NotTheApi(f"{self._url}{path}: answered {status} with a body that is not a "
                            "JSON object", status, _start(raw))
        return Reply(status, payload, etag)


def _start(raw: bytes) -> str:
    return raw[:2000].decode(errors="replace")[:500]
