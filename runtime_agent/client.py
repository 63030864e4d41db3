"""The agent client for synchronous scripts and tests that drive an agent step by step
(scripts/demo.py, the benches, the test harness): a thin wrapper over the one asynchronous
client, ``agent_client.HttpAgentClient``, so the agent's paths, its replies and its tokens are
read in one place.

Each call runs the asynchronous one to its end on one event loop that every synchronous client
shares, in a daemon thread of its own (``_Runner``), over one HTTP session whose connections are
not kept alive (an agent restarted on the same port is reached anew, as by urllib). A call
blocks its caller (as a script expects) and may be made from inside a running event loop too (a
test's), whose loop it leaves alone. A loop and a session per call cost four times urllib's CPU
per call, which the test harness's polling multiplied over the whole suite. A refusal raises
``AgentError`` (status and body); an agent that does not answer raises
``AgentUnreachableError``, an ``OSError`` as the standard library's clients raise. ``url`` may
be changed between calls.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp

from agent_client import AgentUnreachable, HttpAgentClient, NotTheApi, Reply, client_token
from guard.tokens import TokenError

T = TypeVar("T")
Call = Callable[[HttpAgentClient], Awaitable[Reply]]


def read_token(token_file: str | None) -> str | None:  # scripts; the CLI reads it the same way
    """The API token from ``--token-file`` or ``RUNTIME_AGENT_TOKEN`` (``client_token``);
    None when neither."""
    try:
        source = client_token(token_file, os.environ)
    except TokenError as exc:
        raise SystemExit(f"runtime-agent: {exc}") from None
    return source.token() if source is not None else None


class AgentError(RuntimeError):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("message") or f"HTTP {status}")
        self.status = status
        self.body = body


class AgentUnreachableError(ConnectionError):
    """Nothing answered at the agent's address in time."""


class AgentClient:
    def __init__(self, url: str = "http://127.0.0.1:8080", timeout_s: float = 330.0,
                 token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._token = token

    def _run(self, call: Call) -> dict[str, Any]:
        """``call`` on a fresh client; the body of a success, ``AgentError`` otherwise."""
        reply = _blocking(lambda: self._reply(call))
        if not reply.ok:
            raise AgentError(reply.status, dict(reply.body))
        return dict(reply.body)

    async def _reply(self, call: Call) -> Reply:
        client = HttpAgentClient(self.url, _RUNNER.session(), timeout_s=self.timeout_s,
                                 lifecycle_timeout_s=self.timeout_s, token=self._token)
        try:
            return await call(client)
        except NotTheApi as exc:
            if exc.status < 400:
                raise
            return Reply(exc.status, {"status": "error", "message": exc.text})
        except AgentUnreachable as exc:
            raise AgentUnreachableError(str(exc)) from None

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """Any call of the API, for what has no method here."""
        return self._run(lambda c: c.request(method, path, body))

    def health(self) -> dict[str, Any]:
        return self._run(lambda c: c.health())

    def snapshot(self) -> dict[str, Any]:
        return self._run(lambda c: c.snapshot_reply())

    def models(self) -> dict[str, Any]:
        return self._run(lambda c: c.models())

    def activate(self, model_name: str, artifact_url: str, engine: str = "vllm", port: int = 0,
                 args: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
        body = {"model_name": model_name, "artifact_url": artifact_url, "engine": engine,
                "port": port, "engine_config": {"args": args or {}}, **extra}
        return self._run(lambda c: c.activate(body, timeout_s=self.timeout_s))

    def deactivate(self, model_name: str) -> dict[str, Any]:
        return self._run(lambda c: c.deactivate(model_name))

    def sleep(self, model_name: str, level: int = 1,
              operation_id: str | None = None) -> dict[str, Any]:
        return self._run(lambda c: c.sleep(model_name, level, operation_id))

    def wake(self, model_name: str, operation_id: str | None = None) -> dict[str, Any]:
        return self._run(lambda c: c.wake(model_name, operation_id))

    def kv_limit(self, model_name: str, limit_bytes: int,
                 operation_id: str | None = None) -> dict[str, Any]:
        return self._run(lambda c: c.kv_limit(model_name, limit_bytes, operation_id))

    def logs(self, model_name: str, tail: int = 100) -> dict[str, Any]:
        return self._run(lambda c: c.logs(model_name, tail))

    def events(self, since: int = 0, wait: int = 0, boot_id: str | None = None
               ) -> dict[str, Any]:
        """Events after ``since``; with ``boot_id`` (the boot the cursor is from), an agent
        that restarted since answers ``reset: true``."""
        return self._run(lambda c: c.events(since, wait, boot_id))

    def get(self, path: str) -> dict[str, Any]:
        """Any GET of the API, for what has no method here."""
        return self._call("GET", path)

    # ---- the weight cache -------------------------------------------------------------------

    def download(self, artifact_url: str, revision: str | None = None,
                 credentials: dict[str, str] | None = None) -> dict[str, Any]:
        return self._run(lambda c: c.download(artifact_url, revision, credentials))

    def artifacts(self) -> list[dict[str, Any]]:
        return list(self._run(lambda c: c.artifacts())["data"])

    def delete_artifact(self, artifact_id: str) -> dict[str, Any]:
        return self._run(lambda c: c.delete_artifact(artifact_id))


class _Runner:
    """One event loop in a daemon thread and one HTTP session on it, for every synchronous
    client of the process; started on the first call, closed at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="agent-client",
                                 daemon=True).start()
                self._loop = loop
                atexit.register(self.close)
            return self._loop

    def session(self) -> aiohttp.ClientSession:
        """The shared session (called on the runner's loop only)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0))
        return self._session

    def close(self) -> None:
        loop, session = self._loop, self._session
        if loop is None or loop.is_closed():
            return
        if session is not None and not session.closed:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(session.close(), loop).result(2)
        loop.call_soon_threadsafe(loop.stop)


_RUNNER = _Runner()


def _blocking(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to its end on the shared runner loop and wait for it here (a caller's own
    running loop, a test's, is blocked meanwhile, as by any synchronous call)."""
    async def main() -> T:
        return await make()

    return asyncio.run_coroutine_threadsafe(main(), _RUNNER.loop()).result()
