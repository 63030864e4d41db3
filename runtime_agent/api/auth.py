"""The agent API's access rule: ``guard.access`` with the agent's token and error shape.

With a token configured (``--token-file``, ``RUNTIME_AGENT_TOKEN``), every request that changes
something needs ``Authorization: Bearer <token>``; reads need it too with ``--auth-reads``.
``/healthz``, ``/ready`` and ``/metrics`` stay open: kubelet probes and Prometheus scrapes carry
no token, and they change nothing. The rule, its 401 shape and its audit line are the ones every
server shares (``guard.access``); this module only names the agent's parts.
"""

from __future__ import annotations

from aiohttp import web

from guard import access
from guard.tokens import TokenSource
from runtime_agent.api.errors import error_response

OPEN_PATHS = access.OPEN_ROUTES


def install_auth(app: web.Application, token: TokenSource | None, protect_reads: bool) -> None:
    """The access middleware on ``app`` (after the error middleware), with the token file kept
    fresh while the app runs."""
    access.install(app, access.Policy("agent", token, protect_reads), _render)


def _render(status: int, message: str) -> web.Response:
    if status == 401 and "needs a bearer token" in message:
        message += " (the CLI reads RUNTIME_AGENT_TOKEN or --token-file)"
    return error_response(status, message)
