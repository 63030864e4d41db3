"""Runs the real agent as a separate process for integration tests and benchmarks.

The agent gets its own state directory, API port and engine port block, simulated engines and
a fast restart schedule. ``cleanup`` kills the agent and every engine process that carries the
agent's state directory in its environment (whole process groups), so nothing outlives a test.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from engines.cgroups import EngineCgroups
from registry.identity import scan_engines
from runtime_agent.client import AgentClient, AgentError
from runtime_agent.supervision.ports import ephemeral_range

ROOT = Path(__file__).resolve().parent.parent


def http_json(url: str, method: str = "GET", body: bytes | str | dict[str, Any] | None = None,
              timeout: float = 30) -> tuple[int, Any]:
    """One HTTP call; the status and the JSON answer (``{}`` for an empty one), errors too."""
    if isinstance(body, dict):
        body = json.dumps(body)
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def complete(port: int, model: str) -> tuple[int, Any]:
    """A short completion from the engine on ``port`` for ``model``: status and answer."""
    return http_json(f"http://127.0.0.1:{port}/v1/completions", "POST",
                     {"model": model, "prompt": "hello", "max_tokens": 4})


def free_port() -> int:
    """A free port for a server this test starts (not for an engine the test polls while it
    boots: use ``engine_port``, which stays out of the ephemeral range)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


PORT_FLAGS = ("--port", "--claims-port", "--door-port", "--health-probe-port")  # the agent's
PORT_ATTEMPTS = 8  # starts of one daemon that may each lose a port before a test gives up
_TAKEN = re.compile(r"(--[a-z-]+) (\d+): \S+ is already in use")


_BIND_ADDRESS = re.compile(r"while attempting to bind on address \('[^']*', (\d+)\)")


def port_taken(code: int | None, said: str, ours: Mapping[str, int],
               is_free: Callable[[int], bool] | None = None) -> list[str]:
    """The flags, of ``ours`` (flag: port), whose ports another process took first; empty for
    any other end, which stays the test's failure.

    The agent exits 5 (``EXIT_PORT``) saying ``--flag N: host:N is already in use`` for a port
    it binds at start. Its embedded reconciler and door bind later and exit 1 with "... (port
    N) ... cannot listen: ... in use", naming the address the loop tried to bind when it says
    it (that port is the one), else ports but not which one: a port of ours named there that
    is still held now is the one (a test that holds a port of its own on purpose
    keeps that failure). A free port is only a guess until the daemon binds it."""
    named = [m.group(1) for m in _TAKEN.finditer(said) if m.group(1) in ours]
    if code == 5 and named:
        return named
    if code in (1, 5) and "cannot listen" in said and "in use" in said:
        bound = _BIND_ADDRESS.search(said)  # the loop's own error names the address it tried
        if bound is not None:
            return [flag for flag, port in ours.items()
                    if flag != "--port" and port == int(bound.group(1))]
        free = is_free or _free
        return [flag for flag, port in ours.items() if flag != "--port"
                and f"(port {port})" in said and not free(port)]
    return []


def engine_port() -> int:
    """A free port below the ephemeral range, for a process polled before it listens."""
    return free_port_block(1)


def port_is_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def sigint_default() -> None:
    """``preexec_fn`` for a process the test stops with SIGINT: SIGINT at its default, as under
    tini or a terminal. A suite started in the background of a non-interactive shell inherits
    SIGINT ignored, and a shell cannot trap a signal ignored when it started (POSIX), so such a
    process would not stop for the way the suite was launched."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; its final answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def free_port_block(size: int) -> int:
    """The first port of ``size`` consecutive free ports, at random below the kernel's
    ephemeral range (inside it, a probe's own source port can take an engine's port)."""
    top = max(10000 + size, ephemeral_range()[0] - size)
    for _ in range(200):
        low = random.randrange(10000, top)
        if all(_free(p) for p in range(low, low + size)):
            return low
    raise RuntimeError("no free port block found")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _answers(port: int) -> bool:
    """Something on 127.0.0.1:``port`` answers HTTP (any status: it may ask for a token)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        return True
    except OSError:
        return False
    finally:
        conn.close()


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself holds a listening socket on ``port``."""
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="inet"))
    except psutil.Error:
        return False


class AgentProcess:
    def __init__(self, state_dir: Path, *, restart_delays: str = "0.2,0.4,0.8,1.6,3.2",
                 ports: int = 100, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, root: Path = ROOT,
                 engine_host: str | None = "127.0.0.1", shm_dir: Path | None = None,
                 free_ports: Sequence[str] = ()) -> None:
        self.state_dir = state_dir
        self.root = root  # the source tree the agent runs from (a bench compares two)
        self.port = free_port()
        self.port_low = free_port_block(ports)
        self.port_high = self.port_low + ports - 1
        self.restart_delays = restart_delays
        self.extra_args = list(extra_args)
        self.env = dict(env or {})  # over the test's own environment
        # Every port the agent listens on is the harness's to pick, and to pick again when
        # another process takes it before the agent binds (``start``); read them back from
        # ``ports``. A port written into ``extra_args`` could not be picked again.
        named = [flag for flag in PORT_FLAGS if flag in self.extra_args]
        if named:
            raise ValueError(f"{', '.join(named)} in extra_args: name the flag in free_ports "
                             "instead (the harness picks the port, and picks again if taken)")
        embedded = ["--claims-port"] + ([] if "--no-door" in self.extra_args else ["--door-port"])
        wanted = [*free_ports, *(embedded if "--claims" in self.extra_args else [])]
        self.ports = {flag: free_port() for flag in dict.fromkeys(wanted)}
        self.engine_host = engine_host  # None: the agent's own default
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = AgentClient(self.url, timeout_s=60)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = state_dir.parent / f"agent-{state_dir.name}.log"  # not by port: it may move
        # kvcached segments, shared by agents restarted on this state directory: one machine
        # (a Pod's /dev/shm is its own tmpfs). Two agents of one test are two machines, unless
        # a test passes them one shm_dir on purpose: they would claim each other's names.
        self.shm_dir = shm_dir or state_dir.parent / f"{state_dir.name}-shm"
        self.shm_dir.mkdir(parents=True, exist_ok=True)

    def start(self, timeout_s: float = 15.0) -> None:
        """Start the agent and wait until it answers. A port of ours (``--port``, or a flag
        named in ``free_ports``) that another process took between our pick and the agent's
        bind is no test failure: the agent exits 5 naming it, and it starts again on another
        (the ports are read back from ``port``, ``url`` and ``ports``)."""
        for _ in range(PORT_ATTEMPTS):
            taken = self._start_once(timeout_s)
            if not taken:
                return
            for flag in taken:
                self._repick(flag)
        raise RuntimeError(f"agent lost its port {PORT_ATTEMPTS} times:\n{self.log_tail()}")

    def _argv(self) -> list[str]:
        return [sys.executable, "-m", "runtime_agent.cli", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--state-dir", str(self.state_dir), "--engines", "sim",
                "--engine-ports", f"{self.port_low}-{self.port_high}",
                *(["--engine-host", self.engine_host] if self.engine_host else []),
                "--restart-delays", self.restart_delays,
                "--stop-grace", "3", "--scrape-interval", "0.2", "--log-format", "text",
                "--kv-shm-dir", str(self.shm_dir), "--kv-hold-interval", "0.2",
                *self.extra_args,
                *(word for flag, port in self.ports.items() for word in (flag, str(port)))]

    def _start_once(self, timeout_s: float) -> list[str]:
        """One start: nothing once the agent answers, or the flags whose ports were taken."""
        log = self.log_path.open("ab")
        log_from = log.tell()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(self._argv(), cwd=self.root, stdout=log, stderr=log, env=env,
                                     start_new_session=True)
        log.close()
        # A short timeout: until the agent binds, a stranger may hold the port and never answer.
        probe = AgentClient(self.url, timeout_s=2)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = self.log_path.read_bytes()[log_from:].decode(errors="replace")
                taken = port_taken(self.proc.returncode, said, {"--port": self.port, **self.ports})
                if taken:
                    return taken
                raise RuntimeError(f"agent exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, AgentError):
                probe.health()
                # Whoever answers must be ours: another test's agent (pytest-xdist workers pick
                # from the same free ports) may hold the port we picked, and ours is about to
                # exit 5 and pick again.
                if all(_answers(port) for port in self._embedded_ports()) \
                        and listens(self.proc.pid, self.port):
                    return []
            time.sleep(0.02)
        raise RuntimeError(f"agent did not answer within {timeout_s} s:\n{self.log_tail()}")

    def _embedded_ports(self) -> list[int]:
        """The embedded reconciler's and door's ports (``--claims``): they listen once the
        agent does, so a test that goes on after the agent answered waits for them too."""
        args = self._argv()
        if "--claims" not in args:
            return []
        flags = ["--claims-port"] + ([] if "--no-door" in args else ["--door-port"])
        return [int(args[args.index(flag) + 1]) for flag in flags if flag in args]

    def _repick(self, flag: str) -> None:
        if flag == "--port":
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.client.url = self.url  # the test's own client (a token, a timeout) moves along
        else:
            self.ports[flag] = free_port()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the agent alone; its engines are in their own sessions and keep running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.terminate()
        return self.proc.wait(15)

    def cleanup(self) -> None:
        self.kill()
        for found in scan_engines(str(self.state_dir)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(found.pid, signal.SIGKILL)
        cgroups, _ = EngineCgroups.discover(str(self.state_dir))
        if cgroups is not None:  # what left both group and environment: the engines' cgroups
            cgroups.sweep(set())
            cgroups.remove_root()

    # ---- waiting --------------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 20.0,
                 what: str = "condition", poll_s: float | None = None) -> dict[str, Any]:
        """Wait until ``predicate(snapshot)`` holds; woken by the agent's events feed.

        Figures that change without an event (request counts, KV use) need ``poll_s``.
        """
        deadline = time.monotonic() + timeout_s
        cursor = self.client.events(0)["cursor"]
        while True:
            snap = self.client.snapshot()
            if predicate(snap):
                return snap
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {what}; snapshot: {snap}")
            if poll_s is not None:
                time.sleep(poll_s)
                continue
            cursor = self.client.events(cursor, wait=max(1, min(int(left), 2)))["cursor"]

    def engine_said(self, words: str, model: str | None = None) -> bool:
        """Whether an engine's log (kept by the agent in its state directory) holds ``words``:
        a call reached the engine (its record says the call is in flight before it is sent).
        ``model``: that model's engine only (its log is named by its engine id)."""
        logs = self.state_dir / "logs"
        paths = list(logs.glob("*.log")) if model is None else [
            logs / f"{self.model(self.client.snapshot(), model)['engine_id']}.log"]
        return any(words in path.read_text(errors="replace") for path in paths if path.exists())

    def model(self, snap: dict[str, Any], name: str) -> dict[str, Any]:
        for entry in snap["models"]:
            if entry["model_name"] == name:
                return dict(entry)
        raise KeyError(name)

    def wait_phase(self, name: str, phase: str, timeout_s: float = 20.0) -> dict[str, Any]:
        def has_phase(snap: dict[str, Any]) -> bool:
            return any(m["model_name"] == name and m["phase"] == phase for m in snap["models"])

        return self.model(self.wait_for(has_phase, timeout_s, f"{name} {phase}"), name)

    def activate_sim(self, name: str, *sim_flags: str, artifact_url: str | None = None,
                     **extra: Any) -> dict[str, Any]:
        """Activate a simulated engine; ``sim_flags`` like "--sim-startup-seconds=0.1"."""
        args: dict[str, str] = {"--sim-startup-seconds": "0.05"}
        for flag in sim_flags:
            key, _, value = flag.partition("=")
            args[key] = value
        return self.client.activate(name, artifact_url or f"huggingface://test/{name}", "vllm",
                                    args=args, **extra)


@dataclass
class SimProcess:
    """One simulated engine started directly by a test (no agent), in its own process group."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    launched_at: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 10.0) -> None:
        ok = wait_until(lambda: port_is_open(self.port) or self.proc.poll() is not None, timeout)
        assert ok and self.proc.poll() is None, f"engine did not start:\n{self.log()}"

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
