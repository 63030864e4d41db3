"""The kubelet's probes, answered on a port and a thread of their own.

The control API has one event loop; under a burst of clients a ``/healthz`` there waits its turn
behind them (p99 26 ms with 50 clients reading the snapshot, bench/bench_costs.py), and a probe
that times out takes a healthy agent out of its Service. Here a plain thread answers ``/healthz``
and ``/ready`` from a report the event loop publishes every ``interval_s``, as controller-runtime
serves its probes on a port apart from its API (``--health-probe-bind-address``).

The report's age is the liveness check the loop's own ``/healthz`` cannot make: a loop that has
not run for ``stall_after_s`` (blocked by a bad call, starved of CPU) answers 503 ``stalled`` here,
where the loop itself would just not answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

# While a probe waits for the interpreter lock, the busy event loop gives it up after this long
# (Python's default is 5 ms, and a probe needs the lock a handful of times). Only threads that
# ask for the lock pay it: the probe thread sleeps in accept() between probes.
SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class ProbeReport:
    """What the event loop last said: when (monotonic), its health and its readiness."""

    at: float
    health: dict[str, Any]
    not_ready: str | None  # why /ready is not 200, None when it is


def answer(path: str, report: ProbeReport | None, now: float,
           stall_after_s: float) -> tuple[int, dict[str, Any]]:
    """The status and body for a probe of ``path``, given the last report."""
    if path not in ("/healthz", "/ready"):
        return 404, {"error": {"code": "not_found", "message": f"no probe {path}; this port "
                               "answers /healthz and /ready (the API is on --port)"}}
    if report is None:
        return 503, {"status": "starting", "reason": "the agent has not reported yet"}
    age = now - report.at
    if age > stall_after_s:
        return 503, {"status": "stalled", "reason": f"the agent's event loop has not run for "
                     f"{age:.1f} s (more than {stall_after_s:g} s)"}
    if path == "/healthz":
        return 200, report.health
    if report.not_ready is not None:
        return 503, {"status": "not ready", "reason": report.not_ready}
    return 200, {"status": "ready"}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = 2.0  # a client that opens a connection and sends nothing holds one thread this long

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        probes = self.server.probes
        status, body = answer(path, probes.report, time.monotonic(), probes.stall_after_s)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        return None  # probes every few seconds would drown the agent's log


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, sock: socket.socket, probes: ProbeServer) -> None:
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.address_family = sock.family
        self.probes = probes
        self.server_activate()


class ProbeServer:
    """Serves the probes on ``sockets`` (bound by the start-up checks) from its own threads,
    with the report ``make_report`` gives, taken on the event loop every ``interval_s``."""

    def __init__(self, sockets: list[socket.socket],
                 make_report: Callable[[], tuple[dict[str, Any], str | None]],
                 interval_s: float = 0.5, stall_after_s: float = 10.0) -> None:
        self.report: ProbeReport | None = None  # replaced whole: the threads read it unlocked
        self.stall_after_s = stall_after_s
        self._sockets = sockets
        self._make_report = make_report
        self._interval_s = interval_s
        self._servers: list[_Server] = []
        self._threads: list[threading.Thread] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def port(self) -> int:
        return int(self._sockets[0].getsockname()[1])

    def start(self) -> None:
        """Publish the first report and start answering; call on the event loop."""
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._publish()
        for sock in self._sockets:
            server = _Server(sock, self)
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                      name=f"probes:{sock.getsockname()[1]}", daemon=True)
            thread.start()
            self._servers.append(server)
            self._threads.append(thread)

    def _publish(self) -> None:
        try:
            health, not_ready = self._make_report()
        except Exception:  # a report that cannot be made is a stale one: the age tells
            log.exception("the probe report could not be made")
        else:
            self.report = ProbeReport(time.monotonic(), health, not_ready)
        self._timer = asyncio.get_running_loop().call_later(self._interval_s, self._publish)

    async def close(self) -> None:
        """Stop publishing, then stop answering (each thread within its poll interval)."""
        if self._timer is not None:
            self._timer.cancel()
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=1.0)
