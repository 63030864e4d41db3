"""What a new operator meets first (issue 27): every port checked before start-up, a quiet and
fast embedded mode, and a demo that says why it failed and leaves nothing behind.

Each test runs the real command line (``runtime-agent serve``, ``runtime-agent reconcile``,
``scripts/demo.py``) as a separate process against real sockets.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.harness import free_port, wait_until
from tests.test_operator_startup import ROOT, one_line, serve, untouched

pytestmark = pytest.mark.timeout(90)


@contextmanager
def held_port() -> Iterator[int]:
    """A port some other server listens on for as long as the block runs."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_a_door_port_in_use_is_exit_5_before_anything_starts(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    with held_port() as port:
        line = one_line(serve(tmp_path, "--claims", str(claims), "--claims-port",
                              str(free_port()), "--door-port", str(port)), 5,
                        f"--door-port {port}", "already in use")
    assert "--claims-port" not in line  # it names the one port that is taken
    untouched(tmp_path / "state")


def test_the_door_on_the_reconcilers_port_is_exit_5(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    port = str(free_port())
    one_line(serve(tmp_path, "--claims", str(claims), "--claims-port", port, "--door-port", port),
             5, f"--door-port {port}", "--claims-port", "another port")


@pytest.mark.parametrize("flag", ["--port", "--door-port"])
def test_reconcile_with_a_port_in_use_is_exit_5_before_anything_starts(
        tmp_path: Path, flag: str) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    other = "--door-port" if flag == "--port" else "--port"
    with held_port() as port:
        out = subprocess.run(
            [sys.executable, "-m", "runtime_agent.cli", "reconcile", "--claims", str(claims),
             "--state-dir", str(tmp_path / "rec"), flag, str(port), other, str(free_port())],
            cwd=ROOT, capture_output=True, text=True, timeout=45)
    assert out.returncode == 5, out.stderr
    assert "Traceback" not in out.stderr
    assert f"{flag} {port}: 127.0.0.1:{port} is already in use" in out.stderr
    assert not (tmp_path / "rec").exists()  # found before the reconciler wrote anything


def test_an_embedded_agent_starts_quietly_and_stops_at_once_with_a_follower_waiting(
        tmp_path: Path) -> None:
    """The embedded reconciler connected before its agent listened (two alarming lines at
    every start), and a stop waited out the API's shutdown timeout for open long polls."""
    claims = tmp_path / "claims"
    claims.mkdir()
    (tmp_path / "shm").mkdir()
    port, door = free_port(), free_port()
    log = (tmp_path / "agent.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime_agent.cli", "serve", "--host", "127.0.0.1",
         "--port", str(port), "--state-dir", str(tmp_path / "state"), "--engines", "sim",
         "--kv-shm-dir", str(tmp_path / "shm"), "--log-format", "text", "--claims", str(claims),
         "--claims-port", str(free_port()), "--door-port", str(door)],
        cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
    try:
        assert wait_until(lambda: _answers(door, "/healthz"), 30), "the door never answered"
        follower = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        follower.request("GET", "/v1/runtime/events/stream")
        stream = follower.getresponse()  # its headers came: the stream's handler is running
        assert stream.status == 200
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(15)
        stopped_in = time.monotonic() - started
        ended = stream.read()  # the stream ended cleanly (a reset raises here)
        follower.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    text = (tmp_path / "agent.log").read_text()
    assert code == 0, text
    assert ended == b"" or ended.endswith(b"\n")  # whole events (none here), then the end
    warnings = [line for line in text.splitlines() if " WARNING " in line and
                "SIMULATED" not in line]  # the simulation notice is the one warning wanted
    assert warnings == [], text
    assert stopped_in < 1.5, f"stopping took {stopped_in:.2f} s\n{text}"


def test_the_demo_ends_with_the_agents_own_reason_and_leaves_no_directory(
        tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    with held_port() as port:
        out = subprocess.run(
            [sys.executable, "scripts/demo.py", "--port", str(free_port()), "--claims-port",
             str(port), "--door-port", str(free_port())],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "the agent exited with code 5" in out.stderr
    assert f"--claims-port {port}: 127.0.0.1:{port} is already in use" in out.stderr
    assert list((tmp_path / "tmp").iterdir()) == []  # its temporary directory is gone


def _answers(port: int, path: str) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()
