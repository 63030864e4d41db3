"""Who may call what: one bearer check, one refusal shape and one audit line for every server.

The agent API and the reconciler API install ``aiohttp_access`` (a middleware); the front door,
which has its own HTTP server and answers in OpenAI's error format, calls ``check`` and
``Audit`` itself. The rules, the same on each:

* **What is open.** Routes a kubelet or Prometheus calls (``/healthz``, ``/ready``,
  ``/metrics``, ``OPEN_ROUTES``) answer everyone, since probes and scrapes carry no token, and
  they change nothing. A route is judged by the route the router matched (its canonical path),
  never by the request's path string, so no spelling of a path (``//v1/..``, ``%2F``, ``..``,
  a trailing slash) can reach a closed handler as an open one: the string the check reads and
  the route the handler serves are the same thing.
* **What is closed.** With a token configured, every request that is not a read (any method
  but GET, HEAD, OPTIONS) needs ``Authorization: Bearer <token>``, on a route or not (an unknown
  path is a 401, not a 404, to a caller without the token); reads too with ``protect_reads``
  (``--auth-reads``). A route asked with a method it does not take is its 405 (RFC 9110's
  ``Allow`` says what it takes; nothing runs). Anything else (no header, another scheme, two
  headers, a wrong token) is one 401 with ``WWW-Authenticate: Bearer`` and a message that
  says what to send, naming no part of any token. A known principal asking for a thing it may not use is one 403 shape.
* **The audit line.** Every refusal and every accepted request that changes state is one line
  on the ``audit`` logger: ``audit {"server", "method", "path", "client", "principal",
  "result", "reason"}``, JSON, so a path with a newline in it cannot forge a second line; the
  principal is a token's ``sha256:`` prefix, never the token. Refusals are capped at
  ``REFUSALS_PER_WINDOW`` lines per ``WINDOW_S`` (then one line counts those left out): a
  stranger's flood of bad requests must not fill the node's disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware
from msgspec import Struct

from guard.tokens import Credentials, Principal, TokenSource, watch

audit_log = logging.getLogger("audit")

OPEN_ROUTES = frozenset({"/healthz", "/ready", "/metrics"})
READS = frozenset({"GET", "HEAD", "OPTIONS"})
ANONYMOUS = "anonymous"  # the principal of a request to a server that asks for no token
REFUSALS_PER_WINDOW = 50
WINDOW_S = 10.0


class Refusal(Struct, frozen=True):
    status: int  # 401 or 403
    message: str
    reason: str  # for the audit line: no_token, not_bearer, wrong_token, two_headers, ...


def bearer(headers: Sequence[str]) -> tuple[str | None, str]:
    """The token of the ``Authorization`` header values given, and why not when None."""
    if not headers:
        return None, "no_token"
    if len(headers) > 1:
        return None, "two_headers"
    scheme, _, value = headers[0].strip().partition(" ")
    if scheme.lower() != "bearer":
        return None, "not_bearer"
    value = value.strip()
    return (value, "") if value else (None, "no_token")


def check(creds: Credentials, headers: Sequence[str], server: str) -> Principal | Refusal:
    """The principal the ``Authorization`` header values name, or the 401 to answer."""
    given, why = bearer(headers)
    if given is None:
        what = ("send one Authorization header" if why == "two_headers" else
                f"this {server} needs a bearer token: send 'Authorization: Bearer <token>'")
        return Refusal(401, what, why)
    found = creds.match(given)
    if found is None:
        return Refusal(401, f"the bearer token is not this {server}'s", "wrong_token")
    return found


def forbidden(principal: Principal, thing: str, server: str) -> Refusal:
    """The 403 for a known principal asking for what it may not use."""
    return Refusal(403, f"the token {principal.id} may not use {thing!r} on this {server}",
                   "not_allowed")


class Audit:
    """The audit lines of one server (``server``: agent, reconciler, door)."""

    __slots__ = ("server", "clock", "_window", "_logged", "_left_out")

    def __init__(self, server: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.server = server
        self.clock = clock
        self._window = -1e18
        self._logged = 0
        self._left_out = 0

    def _line(self, method: str, path: str, client: str | None, principal: str | None,
              result: int, reason: str | None) -> None:
        audit_log.info("audit %s", json.dumps({
            "server": self.server, "method": method, "path": path, "client": client,
            "principal": principal, "result": result, "reason": reason}))

    def accepted(self, method: str, path: str, client: str | None, principal: str | None,
                 result: int) -> None:
        self._line(method, path, client, principal or ANONYMOUS, result, None)

    def refused(self, method: str, path: str, client: str | None, refusal: Refusal,
                principal: str | None = None) -> None:
        now = self.clock()
        if now - self._window >= WINDOW_S:
            if self._left_out:
                audit_log.warning("audit %s", json.dumps({
                    "server": self.server, "refusals_not_logged": self._left_out,
                    "window_s": WINDOW_S}))
            self._window, self._logged, self._left_out = now, 0, 0
        if self._logged >= REFUSALS_PER_WINDOW:
            self._left_out += 1
            return
        self._logged += 1
        self._line(method, path, client, principal, refusal.status, refusal.reason)


class Policy(Struct, frozen=True):
    """One server's access rule. ``source`` None: no token is asked for (such a server listens
    on loopback unless its operator said ``--insecure-no-auth``)."""

    server: str  # "agent", "reconciler": in messages, the realm and audit lines
    source: TokenSource | None = None
    protect_reads: bool = False
    open_routes: frozenset[str] = OPEN_ROUTES
    also_watch: tuple[object, ...] = ()  # other token files this process should keep fresh


Render = Callable[[int, str], web.Response]


def refusal_response(refusal: Refusal, server: str, render: Render) -> web.Response:
    """The one 401/403 shape: ``render(status, message)`` and, on a 401, ``WWW-Authenticate``."""
    response = render(refusal.status, refusal.message)
    if refusal.status == 401:
        response.headers["WWW-Authenticate"] = f'Bearer realm="{server}"'
    return response


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middleware(policy: Policy, render: Render, audit: Audit | None = None) -> Middleware:
    """The aiohttp middleware enforcing ``policy`` (install it after the error middleware)."""
    audit = audit or Audit(policy.server)
    source = policy.source

    @web.middleware
    async def access(request: web.Request, handler: Handler) -> web.StreamResponse:
        method = request.method
        changes = method not in READS
        principal: str | None = None
        creds = source.credentials() if source is not None else None
        if creds:
            resource = request.match_info.route.resource
            is_open = resource is not None and resource.canonical in policy.open_routes
            if _method_not_allowed(request):
                pass  # a route asked with a method it has not: the 405 changes nothing
            elif not (is_open and not changes) and (changes or policy.protect_reads):
                found = check(creds, request.headers.getall("Authorization", []),
                              policy.server)
                if isinstance(found, Refusal):
                    audit.refused(method, request.path, request.remote, found)
                    return refusal_response(found, policy.server, render)
                principal = found.id
        if not changes:
            return await handler(request)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            audit.accepted(method, request.path, request.remote, principal, status)

    return access


def _method_not_allowed(request: web.Request) -> bool:
    error = getattr(request.match_info, "http_exception", None)
    return error is not None and error.status == 405


def install(app: web.Application, policy: Policy, render: Render) -> None:
    """Add the access middleware to ``app`` (not yet started) and keep its token files fresh
    while it runs."""
    app.middlewares.append(middleware(policy, render))
    sources = (policy.source, *policy.also_watch)

    async def keep_fresh(_: web.Application) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(watch(sources))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(keep_fresh)
