"""The agent client: the only code in the reconciler that talks to runtime agents.

``AgentApi`` is the interface the controllers use; ``HttpAgentClient`` is the real one (aiohttp,
one shared session), and tests give a fake. A refusal is data, not an exception: every control
call returns a ``Reply`` (HTTP status and JSON body, with the agent's ``reason`` such as
``InsufficientGPUMemory``), so a controller can record it and decide. Only an agent that cannot
be reached (connection refused, timeout, a body that is not JSON) raises ``AgentUnreachable``.

This module knows the agent's wire format (README, "The API") and nothing of claims.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp


class AgentUnreachable(Exception):
    """The agent did not answer (or answered something that is not its API)."""


@dataclass(frozen=True)
class Reply:
    """One answer of the agent's control API."""

    status: int
    body: Mapping[str, Any] = field(default_factory=dict)

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


@dataclass(frozen=True)
class ActivateSpec:
    """What the reconciler asks an agent to start (the activate body, README)."""

    model_name: str
    artifact_url: str
    engine: str
    args: Mapping[str, str]
    claim_namespace: str
    claim_name: str
    claim_uid: str
    maximum_footprint_bytes: int
    kv_floor_bytes: int
    kv_limit_bytes: int | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model_name": self.model_name, "artifact_url": self.artifact_url,
            "engine": self.engine, "port": 0, "engine_config": {"args": dict(self.args)},
            "claim_ref": {"namespace": self.claim_namespace, "name": self.claim_name,
                          "uid": self.claim_uid},
            "per_gpu": {"maximum_footprint_bytes": self.maximum_footprint_bytes,
                        "kv_floor_bytes": self.kv_floor_bytes},
        }
        if self.kv_limit_bytes is not None:
            body["kv_limit_bytes"] = self.kv_limit_bytes
        return body


class AgentApi(Protocol):
    """One runtime agent's API, as the controllers use it."""

    @property
    def url(self) -> str: ...

    async def snapshot(self) -> dict[str, Any]:
        """``GET /v1/runtime/snapshot``; raises ``AgentUnreachable``."""
        ...

    async def activate(self, spec: ActivateSpec) -> Reply: ...

    async def deactivate(self, model_name: str) -> Reply: ...

    async def sleep(self, model_name: str, level: int = 1) -> Reply: ...

    async def wake(self, model_name: str) -> Reply: ...

    async def kv_limit(self, model_name: str, limit_bytes: int) -> Reply: ...

    async def download(self, artifact_url: str) -> Reply: ...


class HttpAgentClient:
    """``AgentApi`` over HTTP. ``session``: shared by every agent's client (one pool of
    connections); ``timeout_s``: per call. Sleep and wake wait for the engine, so they get
    ``lifecycle_timeout_s``."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, timeout_s: float = 10.0,
                 lifecycle_timeout_s: float = 330.0) -> None:
        self._url = url.rstrip("/")
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._lifecycle_timeout = aiohttp.ClientTimeout(total=lifecycle_timeout_s)

    @property
    def url(self) -> str:
        return self._url

    async def snapshot(self) -> dict[str, Any]:
        reply = await self._call("GET", "/v1/runtime/snapshot", None, self._timeout)
        if not reply.ok:
            raise AgentUnreachable(f"{self._url}: snapshot answered {reply.status}: "
                                   f"{reply.message}")
        return dict(reply.body)

    async def activate(self, spec: ActivateSpec) -> Reply:
        return await self._call("POST", "/v1/runtime/models/activate", spec.body(),
                                self._timeout)

    async def deactivate(self, model_name: str) -> Reply:
        return await self._call("POST", "/v1/runtime/models/deactivate",
                                {"model_name": model_name, "mode": "stop"},
                                self._lifecycle_timeout)

    async def sleep(self, model_name: str, level: int = 1) -> Reply:
        return await self._call("POST", "/v1/runtime/models/sleep",
                                {"model_name": model_name, "level": level},
                                self._lifecycle_timeout)

    async def wake(self, model_name: str) -> Reply:
        return await self._call("POST", "/v1/runtime/models/wake", {"model_name": model_name},
                                self._lifecycle_timeout)

    async def kv_limit(self, model_name: str, limit_bytes: int) -> Reply:
        return await self._call("POST", "/v1/runtime/models/kv-limit",
                                {"model_name": model_name, "limit_bytes": limit_bytes},
                                self._timeout)

    async def download(self, artifact_url: str) -> Reply:
        """Stage ``artifact_url`` in the agent's weight cache (starts or joins; answers at once)."""
        return await self._call("POST", "/v1/model/download", {"artifact_url": artifact_url},
                                self._timeout)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None,
                    timeout: aiohttp.ClientTimeout) -> Reply:
        try:
            async with self._session.request(method, self._url + path, json=body,
                                             timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            raise AgentUnreachable(f"{self._url}{path}: {str(err) or type(err).__name__}"
                                   ) from None
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            raise AgentUnreachable(f"{self._url}{path}: answered {status} with a body that is "
                                   "not JSON") from None
        if not isinstance(payload, dict):
            raise AgentUnreachable(f"{self._url}{path}: answered {status} with a body that is "
                                   "not a JSON object")
        return Reply(status, payload)
