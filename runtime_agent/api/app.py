"""The agent's HTTP application: its middlewares and every route, in one place.

``/openapi.json`` is built on its first request, not at start: the document (and the 20 answer
models of ``runtime_agent.api.schemas`` it describes) costs the start-up about as much as
everything else the API imports, and most agents are never asked for it (issue 26).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from runtime_agent.api import artifacts, routes, sidecar
from runtime_agent.api.auth import install_auth
from runtime_agent.api.context import AGENT_KEY
from runtime_agent.api.errors import MAX_BODY, errors


def make_app(agent: Any) -> web.Application:
    settings = getattr(agent, "settings", None)
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY)
    if settings is not None:  # every request passes the access rule (guard.access)
        install_auth(app, settings.api_token, settings.auth_reads)
    app[AGENT_KEY] = agent
    routes.add_routes(app)
    sidecar.add_routes(app)
    artifacts.add_routes(app)
    described: list[dict[str, Any]] = []  # built once, when asked: it depends on the code alone

    async def openapi(request: web.Request) -> web.Response:
        if not described:  # tens of milliseconds of schema building: not on the event loop
            document = await asyncio.to_thread(_openapi_document)
            described[:] = described or [document]
        return web.json_response(described[0])

    app.router.add_get("/openapi.json", openapi)
    return app


def _openapi_document() -> dict[str, Any]:
    from runtime_agent.api.openapi import openapi_document

    return openapi_document()
