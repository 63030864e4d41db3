"""A small synchronous client for the agent's HTTP API, for scripts and tests that drive an agent
step by step (scripts/demo.py, the benches, the test harness). The command line and the
reconciler share the asynchronous one, ``reconciler.client``."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from guard.tokens import TokenError, token_source


def read_token(token_file: str | None) -> str | None:  # scripts; the CLI uses preflight's
    """The API token from ``--token-file`` or ``RUNTIME_AGENT_TOKEN`` (``guard.tokens``' rule);
    None when neither."""
    try:
        source = token_source(token_file, os.environ.get("RUNTIME_AGENT_TOKEN"))
    except TokenError as exc:
        raise SystemExit(f"runtime-agent: {exc}") from None
    return source.token() if source is not None else None


class AgentError(RuntimeError):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("message") or f"HTTP {status}")
        self.status = status
        self.body = body


class AgentClient:
    def __init__(self, url: str = "http://127.0.0.1:8080", timeout_s: float = 330.0,
                 token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers=self._headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return dict(json.loads(resp.read() or b"{}"))
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = {"status": "error", "message": raw.decode(errors="replace")[:500]}
            raise AgentError(exc.code, payload) from None

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz")

    def snapshot(self) -> dict[str, Any]:
        return self._call("GET", "/v1/runtime/snapshot")

    def models(self) -> dict[str, Any]:
        return self._call("GET", "/v1/runtime/models")

    def activate(self, model_name: str, artifact_url: str, engine: str = "vllm", port: int = 0,
                 args: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
        body = {"model_name": model_name, "artifact_url": artifact_url, "engine": engine,
                "port": port, "engine_config": {"args": args or {}}, **extra}
        return self._call("POST", "/v1/runtime/models/activate", body)

    def deactivate(self, model_name: str) -> dict[str, Any]:
        return self._call("POST", "/v1/runtime/models/deactivate",
                          {"model_name": model_name, "mode": "stop"})

    def sleep(self, model_name: str, level: int = 1,
              operation_id: str | None = None) -> dict[str, Any]:
        return self._call("POST", "/v1/runtime/models/sleep",
                          {"model_name": model_name, "level": level, "operation_id": operation_id})

    def wake(self, model_name: str, operation_id: str | None = None) -> dict[str, Any]:
        return self._call("POST", "/v1/runtime/models/wake",
                          {"model_name": model_name, "operation_id": operation_id})

    def kv_limit(self, model_name: str, limit_bytes: int,
                 operation_id: str | None = None) -> dict[str, Any]:
        return self._call("POST", "/v1/runtime/models/kv-limit",
                          {"model_name": model_name, "limit_bytes": limit_bytes,
                           "operation_id": operation_id})

    def logs(self, model_name: str, tail: int = 100) -> dict[str, Any]:
        quoted = urllib.parse.quote(model_name, safe="")
        return self._call("GET", f"/v1/runtime/models/{quoted}/logs?tail={tail}")

    def events(self, since: int = 0, wait: int = 0, boot_id: str | None = None
               ) -> dict[str, Any]:
        """Events after ``since``; with ``boot_id`` (the boot the cursor is from), an agent
        that restarted since answers ``reset: true``."""
        query = f"since={since}&wait={wait}"
        if boot_id:
            query += f"&boot_id={urllib.parse.quote(boot_id)}"
        return self._call("GET", f"/v1/runtime/events?{query}")

    def get(self, path: str) -> dict[str, Any]:
        """Any GET of the API, for what has no method here."""
        return self._call("GET", path)

    # ---- the weight cache -------------------------------------------------------------------

    def download(self, artifact_url: str, revision: str | None = None,
                 credentials: dict[str, str] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"artifact_url": artifact_url, "credentials": credentials or {}}
        if revision is not None:
            body["revision"] = revision
        return self._call("POST", "/v1/model/download", body)

    def artifacts(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/model/list")["data"])

    def delete_artifact(self, artifact_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/model/{urllib.parse.quote(artifact_id, safe='')}")
