"""The reconciler's HTTP API (aiohttp): claims, routes, wake requests and metrics.

| method and path | result |
|---|---|
| ``GET /healthz`` | ``{"status": "ok"}`` |
| ``GET /v1/claims`` | ``{"items": [claim...], "problems": [...]}``: every claim's status |
| ``GET /v1/claims/{namespace}/{name}`` | one claim (metadata, spec, status, events, route) |
| ``GET /v1/routes`` | ``{"routes": [{model, claim, agent, host, port, state, reason, ...}]}`` |
| ``POST /v1/routes/{model}/wake`` | records a wake request (202; repeats collapse) |
| ``GET /v1/modelroutes`` | ``{"items": [{name, candidates: [{claim, model, score}], conditions}]}``: each ModelRoute, ``FailedScheduling`` while it matches no claim |
| ``GET /metrics`` | Prometheus exposition: the ModelClaim and reconcile metrics |
| ``GET /openapi.json`` | this table as OpenAPI 3.1 (``reconciler.openapi``) |

Handlers are thin: they read the status store and the route table, or record a wake request
and enqueue its claim. Errors are ``{"status": "error", "message": ...}`` with a 4xx.

Access is the agent's rule (``guard.access``): with a token (``--token-file``; the embedded
reconciler takes the agent's), the wake needs ``Authorization: Bearer <token>`` (a wake starts
an engine and may put another to sleep), and claims and routes too with ``--auth-reads``;
``/healthz`` and ``/metrics`` stay open for probes and scrapes. ``GET /openapi.json``
describes the API (``reconciler.openapi``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from guard import access
from guard.conns import API_LIMITS, GuardedSite, quiet_accept_errors
from guard.tokens import TokenSource
from reconciler.context import Deps
from reconciler.door.routing import describe_routes
from reconciler.openapi import openapi_document
from reconciler.routes import route_of, route_table
from reconciler.status import ACTIVE, ClaimStatus

log = logging.getLogger("reconciler.server")
DEPS_KEY: web.AppKey[Deps] = web.AppKey("deps", Deps)
REGISTRY_KEY: web.AppKey[CollectorRegistry] = web.AppKey("registry", CollectorRegistry)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"status": "error", "message": message}, status=status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Render = Callable[[web.Request, int, str], web.Response]


def error_middleware(render: Render) -> Middleware:
    """Errors shaped by ``render(request, status, message)``: aiohttp's own (no such route, a
    body too large) and any unhandled exception (500, logged), never a stack trace."""
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = render(request, exc.status, exc.text or exc.reason)
            if "Allow" in exc.headers:  # RFC 9110: a 405 says what is allowed
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        except Exception as exc:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return render(request, 500, f"internal error ({type(exc).__name__}); see the "
                          "reconciler log")
    return errors


def _render(request: web.Request, status: int, message: str) -> web.Response:
    if status == 404:
        message = f"no such endpoint: {request.method} {request.path}"
    elif status == 405:
        message = f"{request.method} is not allowed on {request.path}"
    return _error(status, message)


def _healthy(deps: Deps) -> Callable[[str], bool]:
    def healthy(agent: str) -> bool:
        obs = deps.reader.cache.last(agent)
        return obs is not None and obs.ok
    return healthy


def _urls(deps: Deps) -> dict[str, str]:
    return {a.name: a.url for a, _ in deps.reader.desired.agents()}


def claim_json(deps: Deps, st: ClaimStatus) -> dict[str, Any]:
    doc = st.as_json()
    route = route_of(st, _urls(deps), _healthy(deps), deps.books.holds, deps.books.wakes)
    doc["route"] = route.as_json() if route is not None else None
    return doc


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def claims(request: web.Request) -> web.Response:
    deps = request.app[DEPS_KEY]
    seen = deps.reader
    problems = [{"kind": p.kind, "namespace": p.namespace, "name": p.name, "reason": p.reason,
                 "message": p.message, "source": p.source} for p in seen.desired.problems]
    return web.json_response({"items": [claim_json(deps, st) for st in seen.store.claims()],
                              "problems": problems})


async def claim(request: web.Request) -> web.Response:
    deps = request.app[DEPS_KEY]
    key = (request.match_info["namespace"], request.match_info["name"])
    st = deps.reader.store.get(key)
    if st is None:
        return _error(404, f"no claim {key[0]}/{key[1]}")
    return web.json_response(claim_json(deps, st))


async def routes(request: web.Request) -> web.Response:
    deps = request.app[DEPS_KEY]
    table = route_table(deps.reader.store.all(), _urls(deps), _healthy(deps), deps.books.holds,
                        deps.books.wakes)
    return web.json_response({"routes": [r.as_json() for r in table]})


async def modelroutes(request: web.Request) -> web.Response:
    deps = request.app[DEPS_KEY]
    return web.json_response({"items": list(describe_routes(deps.reader.desired).values())})


async def wake(request: web.Request) -> web.Response:
    deps = request.app[DEPS_KEY]
    model = request.match_info["model"]
    key = deps.reader.desired.by_model(model)
    st = deps.reader.store.get(key) if key is not None else None
    if key is None or st is None or st.deleted is not None:
        return _error(404, f"no claim serves model {model!r}")
    if st.phase == ACTIVE:
        return web.json_response({"status": "success", "model": model,
                                  "claim": f"{key[0]}/{key[1]}", "new": False,
                                  "message": "the model serves; nothing to wake"})
    req, new = deps.books.ask_wake(model, key)
    return web.json_response({"status": "accepted", "model": model,
                              "claim": f"{key[0]}/{key[1]}", "new": new,
                              "requests": req.repeats + 1}, status=202)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(deps: Deps, registry: CollectorRegistry, token: TokenSource | None = None,
             protect_reads: bool = False, also_watch: tuple[object, ...] = ()
             ) -> web.Application:
    """The API; with ``token``, what changes state needs it (and reads with
    ``protect_reads``); ``also_watch``: other token files this process keeps fresh."""
    app = web.Application(middlewares=[error_middleware(_render)])
    access.install(app, access.Policy("reconciler", token, protect_reads,
                                      also_watch=also_watch), _error)
    app[DEPS_KEY] = deps
    app[REGISTRY_KEY] = registry
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/claims", claims)
    app.router.add_get("/v1/claims/{namespace}/{name}", claim)
    app.router.add_get("/v1/routes", routes)
    app.router.add_post("/v1/routes/{model:.+}/wake", wake)
    app.router.add_get("/v1/modelroutes", modelroutes)
    app.router.add_get("/metrics", metrics)
    described = openapi_document()

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(described)

    app.router.add_get("/openapi.json", openapi)
    return app


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start ``app`` on ``host:port`` (0: any free port); the runner and the bound port. Its
    connections are capped and must send their first head in time (``guard.conns``)."""
    quiet_accept_errors(asyncio.get_running_loop())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = GuardedSite(runner, API_LIMITS, host=host, port=port)
    await site.start()
    return runner, site.port
