"""The agent's HTTP application: its middlewares and every route, in one place."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from runtime_agent.api import artifacts, routes, sidecar
from runtime_agent.api.auth import install_auth
from runtime_agent.api.context import AGENT_KEY
from runtime_agent.api.errors import MAX_BODY, errors
from runtime_agent.api.openapi import openapi_document


def make_app(agent: Any) -> web.Application:
    settings = getattr(agent, "settings", None)
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY)
    if settings is not None:  # every request passes the access rule (guard.access)
        install_auth(app, settings.api_token, settings.auth_reads)
    app[AGENT_KEY] = agent
    routes.add_routes(app)
    sidecar.add_routes(app)
    artifacts.add_routes(app)
    described = openapi_document()  # built once: it depends on the code alone

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(described)

    app.router.add_get("/openapi.json", openapi)
    return app
