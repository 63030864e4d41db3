"""The agent client: the only code in the reconciler that talks to runtime agents, and the one
HTTP client of every command line (``runtime-agent snapshot``, ``top``, ``claims get``...).

``JsonApi`` speaks JSON over aiohttp to one base URL: one call, one ``Reply``. ``AgentApi`` is
the interface the controllers use; ``HttpAgentClient`` is the real one (``JsonApi`` with the
agent's routes, one shared session), and tests give a fake. A refusal is data, not an
exception: every control call returns a ``Reply`` (HTTP status and JSON body, with the agent's
``reason`` such as ``InsufficientGPUMemory``), so a controller can record it and decide. Only an
agent that cannot be reached (connection refused, timeout) raises ``AgentUnreachable``; one
that answers with a body that is not a JSON object raises its kind ``NotTheApi``.

With a ``token`` (a command line's), every call carries ``Authorization: Bearer <token>``; the
reconciler's session instead carries ``bearer_middleware``, which sends the agents' token as it
is now (a rotated Secret is re-read by ``guard.tokens``) on every call, feeds included.

This module knows the agent's wire format (README, "The API") and nothing of claims.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import ClientHandlerType, ClientRequest, ClientResponse
from aiohttp.client_middlewares import ClientMiddlewareType

from guard.tokens import TokenSource


class AgentUnreachable(Exception):
    """The agent did not answer (or answered something that is not its API)."""


class NotTheApi(AgentUnreachable):
    """Something answered, but not with a JSON object: another service at that address."""


class Refusal(Exception):
    """An answer that is not a success (4xx, 5xx), for callers that stop at the first one."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.message)
        self.reply = reply


def ok_body(reply: Reply) -> Mapping[str, Any]:
    """The body of a successful reply; ``Refusal`` otherwise."""
    if not reply.ok:
        raise Refusal(reply)
    return reply.body


@dataclass(frozen=True)
class Reply:
    """One answer of the agent's control API."""

    status: int
    body: Mapping[str, Any] = field(default_factory=dict)
    etag: str | None = None

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


def bearer_middleware(source: TokenSource | None) -> tuple[ClientMiddlewareType, ...]:
    """Client middlewares that put ``source``'s current token on every request (none
    without a source)."""
    if source is None:
        return ()

    async def bearer(request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        token = source.token()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        return await handler(request)

    return (bearer,)


class JsonApi:
    """JSON over HTTP to one base ``url``. ``session``: shared by every client (one pool of
    connections); ``timeout_s``: per call, unless a call names its own."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, timeout_s: float = 10.0,
                 token: str | None = None) -> None:
        self._url = url.rstrip("/")
        self._session = session
        self._timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    @property
    def url(self) -> str:
        return self._url

    async def request(self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
                      timeout_s: float | None = None,
                      headers: Mapping[str, str] | None = None) -> Reply:
        """One call; any answer is a ``Reply``. Raises ``AgentUnreachable`` when nothing
        answers in time and ``NotTheApi`` when the body is not a JSON object."""
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        return await self._call(method, path, None if body is None else dict(body), timeout,
                                headers)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None,
                    timeout: aiohttp.ClientTimeout,
                    headers: Mapping[str, str] | None = None) -> Reply:
        sent = {**self._headers, **headers} if headers else self._headers
        try:
            async with self._session.request(method, self._url + path, json=body,
                                             timeout=timeout, headers=sent) as resp:
                raw = await resp.read()
                status = resp.status
                etag = resp.headers.get("ETag")
        except (TimeoutError, aiohttp.ClientError, OSError) as err:
            raise AgentUnreachable(f"{self._url}{path}: {str(err) or type(err).__name__}"
                                   ) from None
        if status == 304:
            return Reply(304, {}, etag)
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            raise NotTheApi(f"{self._url}{path}: answered {status} with a body that is not "
                            "JSON") from None
        if not isinstance(payload, dict):
            raise NotTheApi(f"{self._url}{path}: answered {status} with a body that is not a "
                            "JSON object")
        return Reply(status, payload, etag)


class HttpAgentClient(JsonApi):
    """``AgentApi`` over HTTP. Sleep, wake and stop wait for the engine, so they get
    ``lifecycle_timeout_s``."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, timeout_s: float = 10.0,
                 lifecycle_timeout_s: float = 330.0, token: str | None = None) -> None:
        super().__init__(url, session, timeout_s=timeout_s, token=token)
        self._lifecycle_timeout = aiohttp.ClientTimeout(total=lifecycle_timeout_s)
        self._etag: tuple[str, dict[str, Any]] | None = None

    async def snapshot(self) -> dict[str, Any]:
        """The snapshot; an agent that answers ``304 Not Modified`` to the last ETag gets the
        very same object back, so the caller can skip reading it again."""
        headers = {"If-None-Match": self._etag[0]} if self._etag is not None else None
        reply = await self._call("GET", "/v1/runtime/snapshot", None, self._timeout, headers)
        if reply.status == 304 and self._etag is not None:
            return self._etag[1]
        if not reply.ok:
            raise AgentUnreachable(f"{self._url}: snapshot answered {reply.status}: "
                                   f"{reply.message}")
        body = dict(reply.body)
        self._etag = (reply.etag, body) if reply.etag else None
        return body

    async def activate(self, spec: ActivateSpec) -> Reply:
        return await self._call("POST", "/v1/runtime/models/activate", spec.body(),
                                self._timeout)

    async def deactivate(self, model_name: str) -> Reply:
        return await self._call("POST", "/v1/runtime/models/deactivate",
                                {"model_name": model_name, "mode": "stop"},
                                self._lifecycle_timeout)

    async def sleep(self, model_name: str, level: int = 1,
                    operation_id: str | None = None) -> Reply:
        return await self._call("POST", "/v1/runtime/models/sleep",
                                {"model_name": model_name, "level": level,
                                 **_operation(operation_id)}, self._lifecycle_timeout)

    async def wake(self, model_name: str, operation_id: str | None = None) -> Reply:
        return await self._call("POST", "/v1/runtime/models/wake",
                                {"model_name": model_name, **_operation(operation_id)},
                                self._lifecycle_timeout)

    async def kv_limit(self, model_name: str, limit_bytes: int,
                       operation_id: str | None = None) -> Reply:
        return await self._call("POST", "/v1/runtime/models/kv-limit",
                                {"model_name": model_name, "limit_bytes": limit_bytes,
                                 **_operation(operation_id)}, self._timeout)

    async def download(self, artifact_url: str, revision: str | None = None,
                       credentials: Mapping[str, str] | None = None) -> Reply:
        """Stage ``artifact_url`` in the agent's weight cache (starts or joins; answers at once)."""
        body: dict[str, Any] = {"artifact_url": artifact_url}
        if revision is not None:
            body["revision"] = revision
        if credentials:
            body["credentials"] = dict(credentials)
        return await self._call("POST", "/v1/model/download", body, self._timeout)

    async def artifacts(self) -> Reply:
        """``GET /v1/model/list``: the weight cache's entries, under ``data``."""
        return await self._call("GET", "/v1/model/list", None, self._timeout)

    async def delete_artifact(self, artifact_id: str) -> Reply:
        return await self._call("DELETE", f"/v1/model/{urllib.parse.quote(artifact_id, safe='')}",
                                None, self._timeout)

    async def logs(self, model_name: str, tail: int = 100) -> Reply:
        quoted = urllib.parse.quote(model_name, safe="")
        return await self._call("GET", f"/v1/runtime/models/{quoted}/logs?tail={tail}", None,
                                self._timeout)

    async def events(self, since: int = 0, wait: int = 0, boot_id: str | None = None) -> Reply:
        """Events after ``since``, held up to ``wait`` seconds for one; with ``boot_id`` (the
        boot the cursor is from), an agent that restarted since answers ``reset: true``."""
        query = {"since": str(since), "wait": str(wait), **({"boot_id": boot_id} if boot_id
                                                            else {})}
        timeout = aiohttp.ClientTimeout(total=wait + self._timeout_s)
        return await self._call("GET", f"/v1/runtime/events?{urllib.parse.urlencode(query)}",
                                None, timeout)


def _operation(operation_id: str | None) -> dict[str, str]:
    return {} if operation_id is None else {"operation_id": operation_id}
