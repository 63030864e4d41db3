"""The reconciler's name for the agent client (``agent_client``, shared with the agent's command
line): the controllers import ``AgentApi``, ``Reply`` and the errors from here, so where the
client lives is one line. Nothing is defined here."""

from agent_client import (
    ActivateSpec,
    AgentApi,
    AgentUnreachable,
    HttpAgentClient,
    JsonApi,
    NotTheApi,
    Refusal,
    Reply,
    bearer_middleware,
    ok_body,
)

__all__ = ["ActivateSpec", "AgentApi", "AgentUnreachable", "HttpAgentClient", "JsonApi",
           "NotTheApi", "Refusal", "Reply", "bearer_middleware", "ok_body"]
