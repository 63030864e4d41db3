"""Bearer-token authentication for the control API.

With a token configured, every request that changes something needs
``Authorization: Bearer <token>`` (compared in constant time); reads need it too when the agent
is started with ``--auth-reads``. ``/healthz``, ``/ready`` and ``/metrics`` stay open: kubelet
probes and Prometheus scrapes carry no token. A refusal is a 401 that says what is missing and
names no part of the token.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from runtime_agent.api.errors import error_response

OPEN_PATHS = frozenset({"/healthz", "/ready", "/metrics"})
_READS = frozenset({"GET", "HEAD", "OPTIONS"})


def bearer_auth(token: str, protect_reads: bool) -> Callable[..., Awaitable[web.StreamResponse]]:
    expected = token.encode()

    @web.middleware
    async def middleware(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        if request.path in OPEN_PATHS or (request.method in _READS and not protect_reads):
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            return _unauthorized("this agent needs a bearer token: send "
                                 "'Authorization: Bearer <token>' (the CLI reads "
                                 "RUNTIME_AGENT_TOKEN or --token-file)")
        if not hmac.compare_digest(given.strip().encode(), expected):
            return _unauthorized("the bearer token is not this agent's")
        return await handler(request)

    return middleware


def _unauthorized(message: str) -> web.Response:
    response = error_response(401, message)
    response.headers["WWW-Authenticate"] = 'Bearer realm="runtime-agent"'
    return response
