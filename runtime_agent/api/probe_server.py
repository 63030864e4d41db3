"""The process that answers the kubelet's probes (``--health-probe-port``); stdlib only.

The agent starts it with the probe port's listening sockets and a pipe on stdin, and writes a
report (a JSON line: the agent's health and why it is not ready) to the pipe every half second.
This process answers ``/healthz`` and ``/ready`` from the last report. It is a process, not a
thread of the agent, because a thread needs the agent's interpreter lock, which the agent's
busy event loop holds (and, on a loaded node, holds while descheduled): measured, a probe thread
waited as long as the loop's own ``/healthz`` did.

The report's age is the liveness check the loop's own ``/healthz`` cannot make: a loop that has
not written for ``--stall-after`` seconds (blocked, starved of CPU) is answered 503 ``stalled``.
End of input (the agent exited, however it died) ends this process, which closes the port.

    python -m runtime_agent.api.probe_server --fd N [--fd M] [--stall-after 10]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from msgspec import Struct


class ProbeReport(Struct, frozen=True):
    """What the agent last said: when it arrived (monotonic), its health and readiness."""

    at: float
    health: dict[str, Any]
    not_ready: str | None  # why /ready is not 200; None when it is


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


def parse_report(line: bytes, now: float) -> ProbeReport:
    data = json.loads(line)
    return ProbeReport(now, dict(data["health"]), data.get("not_ready"))


class Probes:
    """The last report (replaced whole: the handler threads read it unlocked)."""

    def __init__(self, stall_after_s: float) -> None:
        self.stall_after_s = stall_after_s
        self.report: ProbeReport | None = None

    def follow(self, stream: Any) -> None:
        """Read reports until the agent closes the pipe; then end the process."""
        for line in stream:
            try:
                self.report = parse_report(line, time.monotonic())
            except (ValueError, KeyError, TypeError) as exc:
                print(f"probe server: an unreadable report ({exc}); keeping the last",
                      file=sys.stderr)
        os._exit(0)  # the agent is gone: stop answering for it, now


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = 2.0  # a client that connects and sends nothing holds one thread this long

    def do_GET(self) -> None:
        probes = self.server.probes
        status, body = answer(self.path.split("?", 1)[0], probes.report, time.monotonic(),
                              probes.stall_after_s)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        return None  # a probe every few seconds would drown the agent's log


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, sock: socket.socket, probes: Probes) -> None:
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.probes = probes
        self.server_activate()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the agent's probe server (started by it)")
    parser.add_argument("--fd", type=int, action="append", required=True,
                        help="a bound listening socket inherited from the agent")
    parser.add_argument("--stall-after", type=float, default=10.0)
    args = parser.parse_args(argv)
    probes = Probes(args.stall_after)
    servers = [_Server(socket.socket(fileno=fd), probes) for fd in args.fd]
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    threading.Thread(target=probes.follow, args=(sys.stdin.buffer,), daemon=True).start()
    servers[0].serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
