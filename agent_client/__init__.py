"""The one client of the runtime agent's API, shared by both sides: the reconciler (its
controllers and events feeds) and the agent's own command line and live view import it, and it
imports neither (``.importlinter``: it sits on ``guard`` and aiohttp alone).

- ``agent_client.wire``: JSON over aiohttp, ``Reply``, the errors, bearer tokens;
- ``agent_client.agent``: ``HttpAgentClient``, the one module holding the agent's paths;
- ``agent_client.sse``: the reader of the Server-Sent Events stream.

``runtime_agent.client`` wraps it for synchronous scripts and tests.
"""

from agent_client.agent import ActivateSpec, AgentApi, EventsPage, HttpAgentClient
from agent_client.sse import ServerEvent, SSEError
from agent_client.wire import (
    AgentUnreachable,
    FeedError,
    JsonApi,
    NotTheApi,
    Refusal,
    Reply,
    bearer_middleware,
    client_token,
    ok_body,
)

__all__ = [
    "ActivateSpec", "AgentApi", "AgentUnreachable", "EventsPage", "FeedError", "HttpAgentClient",
    "JsonApi", "NotTheApi", "Refusal", "Reply", "SSEError", "ServerEvent", "bearer_middleware",
    "client_token", "ok_body",
]
