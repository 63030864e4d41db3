"""The kubelet's probes on their own port and thread (runtime_agent.api.probes).

The pure answer for each report; the real listener on a real socket while its event loop is
blocked (a stalled loop is said, not hidden behind a probe that never answers); and the real
agent process with ``--health-probe-port``."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from runtime_agent.api.probe_server import ProbeReport, answer
from runtime_agent.api.probes import ProbeServer
from tests.harness import AgentProcess, free_port
from tests.test_operator_startup import one_line, serve, untouched
from tests.waits import until, until_blocking

pytestmark = pytest.mark.timeout(60)
HEALTH = {"status": "ok", "boot_id": "b"}


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ---- the answer ---------------------------------------------------------------------------------


def test_a_fresh_report_answers_health_and_readiness() -> None:
    report = ProbeReport(100.0, HEALTH, None)
    assert answer("/healthz", report, 101.0, 10.0) == (200, HEALTH)
    assert answer("/ready", report, 101.0, 10.0) == (200, {"status": "ready"})


def test_not_ready_is_503_with_the_reason_and_health_stays_200() -> None:
    report = ProbeReport(100.0, HEALTH, "reading the registry")
    assert answer("/ready", report, 100.5, 10.0) == (
        503, {"status": "not ready", "reason": "reading the registry"})
    assert answer("/healthz", report, 100.5, 10.0)[0] == 200


@pytest.mark.parametrize("path", ["/healthz", "/ready"])
def test_a_report_older_than_the_stall_limit_is_503_stalled(path: str) -> None:
    status, body = answer(path, ProbeReport(100.0, HEALTH, None), 110.5, 10.0)
    assert status == 503 and body["status"] == "stalled"
    assert "10.5 s" in body["reason"]
    assert answer(path, ProbeReport(100.0, HEALTH, None), 110.0, 10.0)[0] == 200


def test_no_report_yet_is_503_starting_and_another_path_is_404() -> None:
    assert answer("/healthz", None, 1.0, 10.0)[0] == 503
    status, body = answer("/snapshot", ProbeReport(1.0, HEALTH, None), 1.0, 10.0)
    assert status == 404 and "/healthz and /ready" in body["error"]["message"]


# ---- the probe server process, on a real socket -------------------------------------------------


def bound_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def until_status(port: int, path: str, status: int, timeout_s: float = 10.0
                       ) -> dict[str, Any]:
    last: list[tuple[int, dict[str, Any]]] = [(0, {})]

    def answered() -> tuple[dict[str, Any]] | None:
        try:
            last[0] = get(port, path)
        except OSError:
            last[0] = (0, {})
        return (last[0][1],) if last[0][0] == status else None

    found = await until(f"{path} to answer {status}", answered, timeout_s,
                        explain=lambda: f"last answer {last[0]}", blocking=True)
    return found[0]


async def test_the_probes_answer_while_the_loop_is_blocked_and_say_it_stalled() -> None:
    reports: list[int] = []

    def report() -> tuple[dict[str, Any], str | None]:
        reports.append(1)
        return HEALTH, None

    probes = ProbeServer([bound_socket()], report, interval_s=0.05, stall_after_s=0.5)
    await probes.start()
    try:
        assert await until_status(probes.port, "/healthz", 200) == HEALTH
        published = len(reports)
        # Block the event loop itself (as a synchronous call on it would): the probe server
        # still answers, and once the last report is older than the limit it says so.
        started = time.monotonic()
        answers = []
        while time.monotonic() - started < 1.5:
            answers.append(get(probes.port, "/healthz"))  # blocking, on the loop: no reports
            time.sleep(0.05)
        assert answers[0][0] == 200
        assert answers[-1][0] == 503 and answers[-1][1]["status"] == "stalled"
        assert len(reports) == published  # nothing was published while the loop was blocked
        # The loop runs again: the next report makes the probes healthy again.
        assert await until_status(probes.port, "/ready", 200) == {"status": "ready"}
    finally:
        await probes.close()
    with pytest.raises(OSError):
        get(probes.port, "/healthz")


async def test_a_probe_server_that_dies_is_started_again_on_the_same_port() -> None:
    probes = ProbeServer([bound_socket()], lambda: (HEALTH, None), interval_s=0.05)
    await probes.start()
    try:
        await until_status(probes.port, "/healthz", 200)
        first = probes.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await until_status(probes.port, "/healthz", 200)
        assert probes.pid != first and probes.starts == 2
    finally:
        await probes.close()


async def test_a_report_that_raises_leaves_the_last_one_to_age() -> None:
    calls = 0

    def report() -> tuple[dict[str, Any], str | None]:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RuntimeError("broken")
        return HEALTH, None

    probes = ProbeServer([bound_socket()], report, interval_s=0.02, stall_after_s=0.3)
    await probes.start()
    try:
        await until_status(probes.port, "/healthz", 200)
        body = await until_status(probes.port, "/healthz", 503)
        assert body["status"] == "stalled" and calls > 3
    finally:
        await probes.close()


# ---- the agent ---------------------------------------------------------------------------------


def healthy(port: int) -> tuple[int, dict[str, Any]]:
    """The probe port's first 200: until the agent's first report reaches the probe process
    (at most one interval after its API answers) it says 503 ``starting``, which is no failure."""
    def answered() -> tuple[int, dict[str, Any]] | None:
        got = get(port, "/healthz")
        assert got[1].get("status") in ("ok", "starting"), got
        return got if got[0] == 200 else None
    return until_blocking("the probe port says healthy", answered, 10)


def test_the_agent_answers_its_probes_on_the_probe_port(tmp_path: Path) -> None:
    agent = AgentProcess(tmp_path / "state", free_ports=["--health-probe-port"])
    try:
        agent.start()
        port = agent.ports["--health-probe-port"]
        status, body = healthy(port)
        assert status == 200 and body["status"] == "ok"
        assert body["boot_id"] == agent.client.health()["boot_id"]
        deadline = time.monotonic() + 10  # the report is at most one interval (0.5 s) old
        while get(port, "/ready")[0] != 200:
            assert time.monotonic() < deadline, get(port, "/ready")
            time.sleep(0.05)
        assert get(port, "/v1/runtime/snapshot")[0] == 404  # the API stays on --port
        assert agent.terminate() == 0  # a clean stop closes the probe port too
        with pytest.raises(OSError):
            get(port, "/healthz")
    finally:
        agent.cleanup()


def test_the_probe_server_ends_with_an_agent_that_is_killed(tmp_path: Path) -> None:
    agent = AgentProcess(tmp_path / "state", free_ports=["--health-probe-port"])
    try:
        agent.start()
        port = agent.ports["--health-probe-port"]
        assert healthy(port)[0] == 200
        agent.kill()  # SIGKILL: no stop path runs; the probe server's pipe closes
        deadline = time.monotonic() + 10
        while True:
            try:
                get(port, "/healthz")
            except OSError:
                break  # the port is closed: nobody answers for a dead agent
            assert time.monotonic() < deadline, "the probe server outlived its agent"
            time.sleep(0.05)
        agent.start()  # and a new agent gets the port at once
        assert healthy(port)[0] == 200
    finally:
        agent.cleanup()


def test_a_probe_port_in_use_is_exit_5_before_the_registry_is_read(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        one_line(serve(tmp_path, "--health-probe-port", str(port)), 5,
                 f"--health-probe-port {port}", "already in use")
    untouched(tmp_path / "state")


def test_the_probe_port_on_the_api_port_is_exit_5(tmp_path: Path) -> None:
    port = str(free_port())
    one_line(serve(tmp_path, "--port", port, "--health-probe-port", port), 5,
             "--health-probe-port", "a port of their own")
