"""The one client of the agent's API (``agent_client``): its events stream against the agent's
real stream handler and against hostile servers, the synchronous wrapper scripts and tests use,
and the rule that no other product module names the agent's paths."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from agent_client import AgentUnreachable, HttpAgentClient, ServerEvent
from runtime_agent.api.app import make_app
from runtime_agent.api.events import EventLog
from runtime_agent.api.limits import Slots
from runtime_agent.client import AgentClient, AgentError
from runtime_agent.supervision.views import EngineEvent

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("contract", "guard", "engines", "registry", "runtime_agent", "reconciler",
           "agent_client")
SERVER_SIDE = "runtime_agent/api/"  # the agent's routes, OpenAPI document and snapshot links
THE_CLIENT = "agent_client/agent.py"


def test_only_the_client_module_names_the_agents_paths() -> None:
    """Done when (issue 23): grep for ``/v1/runtime`` in product code finds the one client
    (and the agent's own server side, which serves those paths)."""
    found = {str(path.relative_to(ROOT)) for package in PRODUCT
             for path in (ROOT / package).rglob("*.py") if "/v1/runtime" in path.read_text()}
    clients = {path for path in found if not path.startswith(SERVER_SIDE)}
    assert clients == {THE_CLIENT}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def serving(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def emit(log: EventLog, model: str) -> None:
    log.append(EngineEvent(at=time.time(), model_name=model, engine_id=f"e-{model}",
                           src="booting", dst="active", reason="Ready", message=""))


async def take(client: HttpAgentClient, count: int, last: str | None = None
               ) -> list[ServerEvent]:
    got: list[ServerEvent] = []
    async with client.stream(last) as events:
        async for event in events:
            got.append(event)
            if len(got) == count:
                break
    return got


async def test_the_stream_follows_the_agents_handler_and_resumes_from_the_last_id() -> None:
    log = EventLog()
    agent = SimpleNamespace(events=log, waiters=Slots(4, "long-polls"),
                            streams=Slots(4, "streams"))
    runner, url = await serving(make_app(agent))
    try:
        async with aiohttp.ClientSession() as session:
            client = HttpAgentClient(url, session)
            emit(log, "a")
            emit(log, "b")
            first = await take(client, 2)
            assert [e.id for e in first] == [f"{log.boot_id}:1", f"{log.boot_id}:2"]
            emit(log, "c")
            resumed = await take(client, 1, first[-1].id)
            assert '"c"' in resumed[0].data and resumed[0].id == f"{log.boot_id}:3"
            reset = await take(client, 1, "another-boot:9")
            assert reset[0].event == "reset"
    finally:
        await runner.cleanup()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def hostile(handler: Handler) -> str:
    """What following a server that answers the stream with ``handler`` raises."""
    app = web.Application()
    app.router.add_get("/v1/runtime/events/stream", handler)
    runner, url = await serving(app)
    try:
        async with aiohttp.ClientSession() as session:
            client = HttpAgentClient(url, session)
            with pytest.raises(AgentUnreachable) as caught:
                await asyncio.wait_for(take(client, 10**6), 20)
            return str(caught.value)
    finally:
        await runner.cleanup()


async def endless(request: web.Request) -> web.StreamResponse:
    """One event that never ends: data lines, forever, never a blank line."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    while True:
        await resp.write(b"data: " + b"x" * 1000 + b"\n")


async def one_long_line(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    while True:
        await resp.write(b"x" * 4096)


async def test_an_event_that_never_ends_is_refused_at_its_bound() -> None:
    assert "over" in await hostile(endless)


async def test_a_line_that_never_ends_is_refused_at_its_bound() -> None:
    assert "over" in await hostile(one_long_line)


async def test_a_stream_refused_says_the_status_and_the_start_of_its_body() -> None:
    async def refuse(request: web.Request) -> web.StreamResponse:
        return web.Response(status=503, text="too many streams")

    assert re.search(r"503: too many streams", await hostile(refuse))


async def test_a_dropped_stream_is_unreachable_not_a_crash() -> None:
    async def drop(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: half")
        assert request.transport is not None
        request.transport.abort()
        return resp

    await hostile(drop)


# -- the synchronous wrapper ------------------------------------------------------------------

@pytest.fixture
async def refusing() -> AsyncIterator[str]:
    async def json_404(request: web.Request) -> web.Response:
        return web.json_response({"status": "error", "message": "no such model"}, status=404)

    async def text_502(request: web.Request) -> web.Response:
        return web.Response(status=502, text="bad gateway")

    app = web.Application()
    app.router.add_get("/v1/runtime/snapshot", json_404)
    app.router.add_get("/v1/runtime/models", text_502)
    runner, url = await serving(app)
    yield url
    await runner.cleanup()


async def test_the_sync_client_raises_agent_errors_with_the_status_and_the_body(
        refusing: str) -> None:
    client = AgentClient(refusing, timeout_s=5)
    loop = asyncio.get_running_loop()
    with pytest.raises(AgentError) as caught:
        await loop.run_in_executor(None, client.snapshot)  # the server runs on this loop
    assert (caught.value.status, str(caught.value)) == (404, "no such model")
    with pytest.raises(AgentError) as caught:
        await loop.run_in_executor(None, client.models)
    assert caught.value.status == 502 and caught.value.body["message"] == "bad gateway"


def test_the_sync_client_raises_an_oserror_when_nothing_answers() -> None:
    with pytest.raises(OSError):
        AgentClient(f"http://127.0.0.1:{free_port()}", timeout_s=2).snapshot()


async def test_the_sync_client_may_be_called_inside_a_running_loop() -> None:
    with pytest.raises(OSError):  # not "asyncio.run() cannot be called from a running loop"
        AgentClient(f"http://127.0.0.1:{free_port()}", timeout_s=2).snapshot()
