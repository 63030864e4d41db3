"""What a new operator meets first (issue 27): every port checked before start-up, a quiet and
fast embedded mode, and a demo that says why it failed and leaves nothing behind.

Each test runs the real command line (``runtime-agent serve``, ``runtime-agent reconcile``,
``scripts/demo.py``) as a separate process against real sockets.
"""

from __future__ import annotations

import http.client
import json
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

from tests.harness import free_port, sigint_default, wait_until
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


def test_claims_check_prints_one_line_per_broken_manifest_and_starts_nothing(
        tmp_path: Path) -> None:
    from tests.reconciler_fakes import claim_yaml

    claims = tmp_path / "claims"
    claims.mkdir()
    (claims / "good.yaml").write_text(claim_yaml("good"))
    (claims / "footprint.yaml").write_text(claim_yaml("footprint", footprint="lots"))
    (claims / "typo.yaml").write_text(claim_yaml("typo").replace("artifactURL", "artifactUrl"))
    (claims / "broken.yaml").write_text("kind: ModelClaim\nmetadata: {name: [unclosed\n")

    def check(*paths: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runtime_agent.cli", "claims", "check",
                               *map(str, paths)], cwd=ROOT, capture_output=True, text=True,
                              timeout=45)

    out = check(claims)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 3, out.stderr
    assert any("footprint.yaml" in line and "footprint" in line for line in lines)
    assert any("typo.yaml" in line and "artifactUrl" in line for line in lines)
    assert any("broken.yaml" in line and "InvalidYAML" in line for line in lines), lines
    out = check(claims / "good.yaml")
    assert out.returncode == 0 and out.stdout == "valid: 1 claim, 0 pools in 1 file\n"
    assert check(tmp_path / "missing.yaml").returncode == 7
    assert sorted(p.name for p in claims.iterdir()) == [  # nothing written beside them
        "broken.yaml", "footprint.yaml", "good.yaml", "typo.yaml"]


def test_claims_get_watch_prints_a_row_when_a_claim_changes_and_ends_quietly_on_ctrl_c(
        agent_factory, tmp_path: Path) -> None:
    from tests.reconciler_fakes import claim_yaml

    claims = tmp_path / "claims"
    claims.mkdir()
    agent = agent_factory(extra_args=("--claims", str(claims), "--no-door"),
                          free_ports=["--claims-port"])
    port = agent.ports["--claims-port"]
    watch = subprocess.Popen(
        [sys.executable, "-m", "runtime_agent.cli", "claims", "get", "-w", "--url",
         f"127.0.0.1:{port}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=sigint_default)  # Ctrl-C reaches it however the suite started
    try:
        assert watch.stdout is not None
        assert watch.stdout.readline().split() == ["NAME", "PHASE", "DESIRED", "READY",
                                                   "ENGINE", "ARTIFACT", "AGE"]
        (claims / "c.yaml").write_text(claim_yaml("c", args={"--sim-startup-seconds": "0.1"}))
        phases = []
        while "Active" not in phases:  # a row per change, up to the claim's Active
            phases.append(watch.stdout.readline().split()[1])
        assert phases[0] != "Active" or len(phases) == 1
        (claims / "c.yaml").unlink()
        while (words := watch.stdout.readline().split())[1] != "<deleted>":
            pass
        assert words[0] == "c"
        watch.send_signal(signal.SIGINT)
        assert watch.wait(10) == 0
        assert "Traceback" not in (watch.stderr.read() if watch.stderr else "")
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        for stream in (watch.stdout, watch.stderr):
            if stream is not None:
                stream.close()


def test_a_file_as_state_dir_and_an_unknown_flag_say_what_to_do(tmp_path: Path) -> None:
    state = tmp_path / "passwd"
    state.write_text("root:x:0:0\n")
    one_line(serve(tmp_path, "--state-dir", str(state)), 4, "is a file, not a directory")
    assert state.read_text() == "root:x:0:0\n"
    one_line(serve(tmp_path, "--bogus"), 2, "--bogus", "see runtime-agent serve --help")


def test_a_new_claims_first_kv_limit_says_no_was(agent_factory, tmp_path: Path) -> None:
    """The first KVLimitSet read "KV limit 59.0 GiB (was 1.0 GiB)": the engine's own KV size
    taken for a limit the claim had set before."""
    from tests.reconciler_fakes import claim_yaml

    claims = tmp_path / "claims"
    claims.mkdir()
    agent = agent_factory(extra_args=("--claims", str(claims), "--no-door"),
                          free_ports=["--claims-port"])
    port = agent.ports["--claims-port"]
    (claims / "c.yaml").write_text(claim_yaml("c", args={"--sim-startup-seconds": "0.1"}))
    agent.wait_phase("c", "active", timeout_s=30)

    def kv_events() -> list[str]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/v1/claims/default/c")
            doc = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        return [e["message"] for e in doc.get("events", [])
                if e["reason"] == "KVLimitSet"]

    assert wait_until(lambda: bool(kv_events()), 30), "no KVLimitSet event"
    first = kv_events()[0]
    assert first.startswith("KV limit ") and "(was" not in first, first
