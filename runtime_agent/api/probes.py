"""The kubelet's probes on a port and a process of their own (``--health-probe-port``).

The control API has one event loop; under a burst of clients a ``/healthz`` there waits its turn
behind them (p99 26 ms with 50 clients reading the snapshot, bench/bench_costs.py), and a probe
that times out takes a healthy agent out of its Service. As controller-runtime serves its probes
apart from its API (``--health-probe-bind-address``), the agent hands the probe port's sockets to
a small process (``runtime_agent.api.probe_server``) and tells it, every ``interval_s``, its
health and readiness; that process answers from the last report, and says ``stalled`` when
reports stop coming.

The agent keeps the sockets open, so a probe server that dies is started again on the same port
(after a growing pause); the probe server ends by itself when the agent does (its pipe closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime_agent.loops import Throttled, keep_running

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
MAX_UNREAD = 64 * 1024  # reports the probe server has not read: past this, skip (it is stuck)


class ProbeServer:
    """Runs the probe server on ``sockets`` (bound by the start-up checks) and feeds it the
    report ``make_report`` gives on the event loop every ``interval_s``."""

    def __init__(self, sockets: list[socket.socket],
                 make_report: Callable[[], tuple[dict[str, Any], str | None]],
                 interval_s: float = 0.5, stall_after_s: float = 10.0) -> None:
        self._sockets = sockets
        self._make_report = make_report
        self._interval_s = interval_s
        self._stall_after_s = stall_after_s
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closing = False
        self._throttled = Throttled(log)
        self.starts = 0  # probe server processes started (1 unless one died)

    @property
    def port(self) -> int:
        return int(self._sockets[0].getsockname()[1])

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        """Start the probe server and the reports; the port answers from here on."""
        for sock in self._sockets:
            sock.listen(128)
        await self._spawn()
        self._publish()
        self._task = asyncio.create_task(
            keep_running("the probe server", self._watch, self._throttled, first_pause_s=0.5),
            name="probe-server")

    async def _spawn(self) -> None:
        fds = [sock.fileno() for sock in self._sockets]
        argv = [sys.executable, "-m", "runtime_agent.api.probe_server",
                "--stall-after", str(self._stall_after_s)]
        for fd in fds:
            argv += ["--fd", str(fd)]
        # Its own session (a terminal's ^C is the agent's to handle) and none of the agent's
        # environment (tokens): only where Python finds this package.
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(PACKAGE_ROOT)}
        self._proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, pass_fds=fds, start_new_session=True,
            env=env)
        self.starts += 1
        if self.starts > 1:
            self._publish_once()  # the new one needs no half second to be right

    async def _watch(self) -> None:
        """Wait for the probe server to exit; one that exits while the agent runs is started
        again (keep_running's pause grows while it keeps dying)."""
        assert self._proc is not None
        code = await self._proc.wait()
        if self._closing:
            return
        await self._spawn()
        raise RuntimeError(f"the probe server exited with {code}; started it again")

    def _publish_once(self) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            return
        try:
            health, not_ready = self._make_report()
        except Exception as exc:  # noqa: BLE001 - no report: its age says so on the probe port
            self._throttled.warning("report", "the probe report could not be made (%s: %s)",
                                    type(exc).__name__, exc)
            return
        if proc.stdin.transport.get_write_buffer_size() > MAX_UNREAD:
            return
        proc.stdin.write(json.dumps({"health": health, "not_ready": not_ready}).encode() + b"\n")

    def _publish(self) -> None:
        self._publish_once()
        self._timer = asyncio.get_running_loop().call_later(self._interval_s, self._publish)

    async def close(self) -> None:
        """Stop the reports and the probe server (its input closes; killed after 2 s)."""
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        proc = self._proc
        if proc is not None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 2.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for sock in self._sockets:
            sock.close()
