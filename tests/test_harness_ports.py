"""The harness never depends on a port staying free between its pick and the daemon's bind.

On a busy machine another process took the port the harness had picked for an agent before
the agent bound it, and the test errored at setup ("agent exited with 5: ... already in use").
Here a squatter takes the picked port on purpose, and the agent must come up on another;
``tests/port_noise.py`` does the same at random to the whole suite.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.harness import AgentProcess, http_json, port_taken
from tests.port_noise import pick, run, take


@contextmanager
def squatting(port: int) -> Iterator[socket.socket]:
    """Another process's listener on ``port`` (every address), as a stranger's would be."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # over the agent's TIME_WAITs
        sock.bind(("0.0.0.0", port))
        sock.listen(1)
        yield sock
    finally:
        sock.close()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_an_agent_whose_picked_port_is_taken_first_starts_on_another(
        agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory(start=False)
    picked = agent.port
    with squatting(picked):
        agent.start()
        assert agent.port != picked
        assert agent.client.health()["status"] == "ok"
    assert agent.url.endswith(f":{agent.port}")


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_restart_whose_old_port_was_taken_meanwhile_starts_on_another(
        agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory()
    agent.kill()
    with squatting(agent.port):
        old = agent.port
        agent.start()
        assert agent.port != old and agent.client.health()["status"] == "ok"


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_taken_claims_port_is_picked_again_and_read_back(
        tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    agent = agent_factory(start=False, free_ports=["--claims-port"],
                          extra_args=["--claims", str(claims), "--no-door"])
    picked = agent.ports["--claims-port"]
    with squatting(picked):
        agent.start()
    assert agent.ports["--claims-port"] != picked
    status, _ = http_json(f"http://127.0.0.1:{agent.ports['--claims-port']}/healthz")
    assert status == 200


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_stranger_answering_like_an_agent_on_the_picked_port_is_not_taken_for_ours(
        agent_factory: Callable[..., AgentProcess]) -> None:
    """Fresh-clone run on 3 xdist workers: another test's agent held the port picked for ours,
    answered the harness's health probe, and the test talked to it until it went away."""
    import http.server
    import json
    import threading

    class Agentlike(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = json.dumps({"status": "ok", "boot_id": "not-ours"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    agent = agent_factory(start=False)
    picked = agent.port
    stranger = http.server.HTTPServer(("127.0.0.1", picked), Agentlike)
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    try:
        agent.start()
        assert agent.port != picked
        assert agent.client.health()["boot_id"] != "not-ours"
    finally:
        stranger.shutdown()
        stranger.server_close()


@pytest.mark.parametrize("flag", ["--port", "--claims-port", "--door-port",
                                  "--health-probe-port"])
def test_a_port_written_into_the_arguments_is_refused_before_anything_starts(
        tmp_path: Path, flag: str) -> None:
    """Run 25 under port noise: a test wrote its door and claims ports into extra_args, the
    noise took one first, and the harness could not pick it again."""
    with pytest.raises(ValueError, match=f"{flag} in extra_args: name the flag in free_ports"):
        AgentProcess(tmp_path / "state", extra_args=[flag, "4100"])


def test_the_embedded_reconcilers_and_doors_ports_are_the_harnesss_to_pick(
        tmp_path: Path) -> None:
    claims = ["--claims", str(tmp_path / "claims")]
    both = AgentProcess(tmp_path / "a", extra_args=claims)
    assert set(both.ports) == {"--claims-port", "--door-port"}
    assert both._argv()[-4:] == ["--claims-port", str(both.ports["--claims-port"]),
                                 "--door-port", str(both.ports["--door-port"])]
    no_door = AgentProcess(tmp_path / "b", extra_args=[*claims, "--no-door"],
                           free_ports=["--claims-port"])
    assert set(no_door.ports) == {"--claims-port"}
    assert set(AgentProcess(tmp_path / "c").ports) == set()


OURS = {"--port": 4100, "--claims-port": 4101, "--door-port": 4103}
DOOR_LINE = ("runtime-agent: the embedded reconciler (port 4101) or its front door (port 4103) "
             "cannot listen: [Errno 98] address already in use; choose other ports")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("code", "said", "held", "taken"), [
    (5, "runtime-agent serve: --port 4100: 127.0.0.1:4100 is already in use (another agent?)",
     set(), ["--port"]),
    (5, "--claims-port 4101: 127.0.0.1:4101 is already in use", set(), ["--claims-port"]),
    (1, DOOR_LINE, {4103}, ["--door-port"]),  # the one still held is the one that was taken
    (1, DOOR_LINE, {4101, 4103}, ["--claims-port", "--door-port"]),
    (1, DOOR_LINE, set(), []),  # given back already: no way to tell, the test fails as before
    (1, DOOR_LINE.replace("(port 4103)", "(port 4200)"), {4200}, []),  # the test's own port
    (1, DOOR_LINE.replace("[Errno 98]", "[Errno 98] error while attempting to bind on address "
                          "('127.0.0.1', 4103):"), set(), ["--door-port"]),  # named: given back
    (5, "--state-dir x is busy", set(), []),  # not a port
    (3, "--port 4100: 127.0.0.1:4100 is already in use", set(), []),
    (5, "--health-probe-port 4102: 127.0.0.1:4102 is already in use", set(), []),  # not ours
])
def test_only_a_port_of_ours_that_was_taken_is_picked_again(
        code: int, said: str, held: set[int], taken: list[str]) -> None:
    assert port_taken(code, said, OURS, lambda port: port not in held) == taken


def _free_now(ports: range) -> set[int]:
    free = set()
    for port in ports:
        sock = take(port, "127.0.0.1")
        if sock is not None:
            free.add(port)
            sock.close()
    return free


@pytest.mark.timeout(30)
def test_port_noise_takes_ports_only_in_its_ranges_and_gives_them_back() -> None:
    ports = range(9100, 9110)  # below the harness's engine blocks and the ephemeral range
    rng = random.Random(1)
    assert {pick(rng, [(9100, 9109)]) for _ in range(50)} <= set(ports)
    free = _free_now(ports)
    assert run(0.3, 200.0, (0.001, 0.002), 4, [(9100, 9109)], host="127.0.0.1", seed=1) > 0
    assert _free_now(ports) >= free  # every port it took is closed again
