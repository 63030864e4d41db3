"""Fixtures for the weight-cache tests: a local Hub, moto's S3 server, an agent with a cache."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import AgentProcess, wait_until
from tests.hubserver import FakeHub

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}
NO_AWS = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_EC2_METADATA_DISABLED": "true",
          "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    server = FakeHub().start()
    yield server
    server.stop()


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any]]:
    """moto's S3 server on a free port: (endpoint, a boto3 client)."""
    import boto3
    from moto.server import ThreadedMotoServer

    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    yield endpoint, boto3.client("s3", endpoint_url=endpoint)
    server.stop()


def cache_agent(factory: Callable[..., AgentProcess], cache_dir: Path, hub: FakeHub | None = None,
                s3_endpoint: str | None = None, extra: tuple[str, ...] = (),
                env: dict[str, str] | None = None, start: bool = True) -> AgentProcess:
    args = ["--weight-cache-dir", str(cache_dir), "--artifact-reserve", "0", *extra]
    if s3_endpoint:
        args += ["--s3-endpoint-url", s3_endpoint]
    full_env = {"HF_ENDPOINT": hub.url if hub else "http://127.0.0.1:9", "HF_TOKEN": "",
                **(env or {})}
    return factory(extra_args=args, env=full_env, start=start)


def entry(agent: AgentProcess, artifact_id: str) -> dict[str, Any] | None:
    return next((e for e in agent.client.artifacts() if e["artifact_id"] == artifact_id), None)


def wait_entry(agent: AgentProcess, artifact_id: str,
               done: Callable[[dict[str, Any]], bool] = lambda e: e["state"] != "downloading",
               timeout: float = 30.0) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def check() -> bool:
        e = entry(agent, artifact_id)
        seen["e"] = e
        return e is not None and done(e)

    assert wait_until(check, timeout, 0.05), f"entry {artifact_id}: {seen.get('e')}\n" \
        f"{agent.log_tail()}"
    return seen["e"]


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small tmpfs at ``path`` (the test is skipped, saying why, when mounting is refused)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a full-disk test mounts a small tmpfs, which needs root")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"mounting a tmpfs was refused: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
