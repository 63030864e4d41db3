"""How a handler finds the agent it serves: the one application key every API module uses."""

from __future__ import annotations

from typing import Any

from aiohttp import web

AGENT_KEY: web.AppKey[Any] = web.AppKey("agent", object)


def agent_of(request: web.Request) -> Any:
    return request.app[AGENT_KEY]
