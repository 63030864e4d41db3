"""The client of a runtime agent's API: the one module that knows its paths (``/v1/runtime/...``,
the weight cache's ``/v1/model/...``), for every caller: the reconciler's controllers and its
events feed, the command line (``runtime-agent snapshot``, ``events -f``, ``download``), the live
view (``top``) and, through ``runtime_agent.client``, scripts and tests. (The agent's own routes,
``runtime_agent/api``, are the server side of the same paths.)

``AgentApi`` is the interface the controllers use; ``HttpAgentClient`` is the real one and tests
give a fake. Control calls answer a ``Reply`` (``agent_client.wire``); the snapshot raises
``AgentUnreachable`` unless it got one. The events feed comes two ways: ``events_page`` (one
long-poll page, checked) and ``stream`` (Server-Sent Events, ``agent_client.sse``).
"""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from agent_client.sse import ServerEvent, SSEError, read_events
from agent_client.wire import AgentUnreachable, FeedError, JsonApi, Reply

RUNTIME = "/v1/runtime"
EVENTS = RUNTIME + "/events"
STREAM = EVENTS + "/stream"


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
    # None (both): no figures; the agent measures the engine, starting it alone on its GPUs
    maximum_footprint_bytes: int | None
    kv_floor_bytes: int | None
    kv_limit_bytes: int | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model_name": self.model_name, "artifact_url": self.artifact_url,
            "engine": self.engine, "port": 0, "engine_config": {"args": dict(self.args)},
            "claim_ref": {"namespace": self.claim_namespace, "name": self.claim_name,
                          "uid": self.claim_uid},
        }
        if self.maximum_footprint_bytes is not None and self.kv_floor_bytes is not None:
            body["per_gpu"] = {"maximum_footprint_bytes": self.maximum_footprint_bytes,
                               "kv_floor_bytes": self.kv_floor_bytes}
        if self.kv_limit_bytes is not None:
            body["kv_limit_bytes"] = self.kv_limit_bytes
        return body


@dataclass(frozen=True)
class EventsPage:
    """One page of the long-poll feed: events after the asked cursor (sorted by ``seq``), the
    page's cursor, the agent's boot id (None from an agent that does not say)."""

    events: Sequence[Mapping[str, Any]]
    cursor: int
    boot_id: str | None


class AgentApi(Protocol):
    """One runtime agent's API, as the controllers use it."""

    @property
    def url(self) -> str: ...

    async def snapshot(self) -> dict[str, Any]:
        """The agent's snapshot; raises ``AgentUnreachable``."""
        ...

    async def fresh_snapshot(self, models: Sequence[str]) -> dict[str, Any]:
        """The snapshot with ``models``' request figures read from their engines during this
        call (``?fresh=requests``): the last look before an idle sleep. Raises
        ``AgentUnreachable``."""
        ...

    async def activate(self, spec: ActivateSpec) -> Reply: ...

    async def deactivate(self, model_name: str) -> Reply: ...

    async def sleep(self, model_name: str, level: int = 1) -> Reply: ...

    async def wake(self, model_name: str) -> Reply: ...

    async def kv_limit(self, model_name: str, limit_bytes: int) -> Reply: ...

    async def download(self, artifact_url: str) -> Reply: ...


class HttpAgentClient(JsonApi):
    """``AgentApi`` over HTTP. Sleep, wake and stop wait for the engine, so they get
    ``lifecycle_timeout_s``."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, timeout_s: float = 10.0,
                 lifecycle_timeout_s: float = 330.0, token: str | None = None) -> None:
        super().__init__(url, session, timeout_s=timeout_s, token=token)
        self._lifecycle_timeout = aiohttp.ClientTimeout(total=lifecycle_timeout_s)
        self._etag: tuple[str, dict[str, Any]] | None = None

    async def health(self) -> Reply:
        return await self._call("GET", "/healthz", None, self._timeout)

    async def snapshot(self) -> dict[str, Any]:
        """The snapshot; an agent that answers ``304 Not Modified`` to the last ETag gets the
        very same object back, so the caller can skip reading it again."""
        headers = {"If-None-Match": self._etag[0]} if self._etag is not None else None
        reply = await self._call("GET", RUNTIME + "/snapshot", None, self._timeout, headers)
        if reply.status == 304 and self._etag is not None:
            return self._etag[1]
        if not reply.ok:
            raise AgentUnreachable(f"{self._url}: snapshot answered {reply.status}: "
                                   f"{reply.message}")
        body = dict(reply.body)
        self._etag = (reply.etag, body) if reply.etag else None
        return body

    async def fresh_snapshot(self, models: Sequence[str]) -> dict[str, Any]:
        """``?fresh=requests&model=...``: each named engine's request figures are read after
        the call arrived; one that did not answer says ``request_metrics_observed: false``.
        An agent without the parameter answers its plain snapshot, whose entries then lack
        ``request_figures_fresh``: a caller must treat that as not fresh."""
        query = urllib.parse.urlencode([("fresh", "requests"), *(("model", m) for m in models)])
        reply = await self._call("GET", f"{RUNTIME}/snapshot?{query}", None, self._timeout)
        if not reply.ok:
            raise AgentUnreachable(f"{self._url}: fresh snapshot answered {reply.status}: "
                                   f"{reply.message}")
        return dict(reply.body)

    async def snapshot_reply(self) -> Reply:
        """The snapshot as a ``Reply`` (a refusal is data), without the ETag cache."""
        return await self._call("GET", RUNTIME + "/snapshot", None, self._timeout)

    async def models(self) -> Reply:
        return await self._call("GET", RUNTIME + "/models", None, self._timeout)

    async def activate(self, spec: ActivateSpec | Mapping[str, Any], *,
                       timeout_s: float | None = None) -> Reply:
        """Start an engine: a spec (the reconciler's) or a whole activate body (the command
        line's, which waits ``timeout_s`` for the engine)."""
        body = spec.body() if isinstance(spec, ActivateSpec) else dict(spec)
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        return await self._call("POST", RUNTIME + "/models/activate", body, timeout)

    async def deactivate(self, model_name: str) -> Reply:
        return await self._call("POST", RUNTIME + "/models/deactivate",
                                {"model_name": model_name, "mode": "stop"},
                                self._lifecycle_timeout)

    async def sleep(self, model_name: str, level: int = 1,
                    operation_id: str | None = None) -> Reply:
        return await self._call("POST", RUNTIME + "/models/sleep",
                                {"model_name": model_name, "level": level,
                                 **_operation(operation_id)}, self._lifecycle_timeout)

    async def wake(self, model_name: str, operation_id: str | None = None) -> Reply:
        return await self._call("POST", RUNTIME + "/models/wake",
                                {"model_name": model_name, **_operation(operation_id)},
                                self._lifecycle_timeout)

    async def kv_limit(self, model_name: str, limit_bytes: int,
                       operation_id: str | None = None) -> Reply:
        return await self._call("POST", RUNTIME + "/models/kv-limit",
                                {"model_name": model_name, "limit_bytes": limit_bytes,
                                 **_operation(operation_id)}, self._timeout)

    async def logs(self, model_name: str, tail: int = 100) -> Reply:
        quoted = urllib.parse.quote(model_name, safe="")
        return await self._call("GET", f"{RUNTIME}/models/{quoted}/logs?tail={tail}", None,
                                self._timeout)

    # ---- the weight cache -------------------------------------------------------------------

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

    # ---- the events feed --------------------------------------------------------------------

    async def events(self, since: int = 0, wait: int = 0, boot_id: str | None = None, *,
                     timeout_s: float | None = None) -> Reply:
        """Events after ``since``, held up to ``wait`` seconds for one; with ``boot_id`` (the
        boot the cursor is from), an agent that restarted since answers ``reset: true``. The
        call may take ``wait`` plus ``timeout_s`` (default: the client's)."""
        query = {"since": str(since), "wait": str(wait), **({"boot_id": boot_id} if boot_id
                                                            else {})}
        slack = self._timeout_s if timeout_s is None else timeout_s
        timeout = aiohttp.ClientTimeout(total=wait + slack)
        return await self._call("GET", f"{EVENTS}?{urllib.parse.urlencode(query)}", None,
                                timeout)

    async def events_page(self, since: int, wait: int, boot_id: str | None = None, *,
                          timeout_s: float | None = None) -> EventsPage:
        """``events`` as a checked page; ``FeedError`` for an answer that is not one."""
        reply = await self.events(since, wait, boot_id, timeout_s=timeout_s)
        if not reply.ok:
            raise FeedError(f"{self._url}: the events feed answered {reply.status}: "
                            f"{reply.message}")
        try:
            events = sorted(reply.body["events"], key=lambda e: int(e["seq"]))
            cursor = int(reply.body["cursor"])
        except (TypeError, KeyError, ValueError) as err:
            raise FeedError(f"{self._url}: not an events page: {err!r}") from None
        if events:
            cursor = max(cursor, int(events[-1]["seq"]))
        boot = reply.body.get("boot_id")
        return EventsPage(events, cursor, boot if isinstance(boot, str) else None)

    @contextlib.asynccontextmanager
    async def stream(self, last_event_id: str | None = None, *, connect_s: float = 5.0,
                     idle_s: float = 60.0) -> AsyncIterator[AsyncIterator[ServerEvent]]:
        """The Server-Sent Events feed, opened: ``async with client.stream(last) as events``.
        A reconnect passes the last id seen (``BOOT:SEQ``); an agent that restarted since
        sends a ``reset`` event first. Any failure, on opening or while reading (nothing for
        ``idle_s``, a dropped connection, a bound of the reader), is ``AgentUnreachable``."""
        headers = dict(self._headers)
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=idle_s)
        try:
            async with self._session.get(self._url + STREAM, headers=headers,
                                         timeout=timeout) as resp:
                if resp.status != 200:
                    body = await resp.text(errors="replace")
                    raise AgentUnreachable(f"the events feed answered {resp.status}: "
                                           f"{body[:200]}")
                yield _unreachable_on_failure(read_events(resp.content))
        except (TimeoutError, aiohttp.ClientError, OSError) as err:
            raise AgentUnreachable(f"{self._url}{STREAM}: {str(err) or type(err).__name__}"
                                   ) from None


async def _unreachable_on_failure(events: AsyncIterator[ServerEvent]
                                  ) -> AsyncIterator[ServerEvent]:
    try:
        async for event in events:
            yield event
    except (TimeoutError, aiohttp.ClientError, OSError, SSEError) as err:
        raise AgentUnreachable(f"the events stream: {str(err) or type(err).__name__}"
                               ) from None


def _operation(operation_id: str | None) -> dict[str, str]:
    return {} if operation_id is None else {"operation_id": operation_id}
