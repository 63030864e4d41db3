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


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("code", "said", "taken"), [
    (5, "runtime-agent serve: --port 4100: 127.0.0.1:4100 is already in use (another agent?)",
     ["--port"]),
    (5, "--claims-port 4101: 127.0.0.1:4101 is already in use", ["--claims-port"]),
    (1, "the embedded reconciler (port 1) or its front door (port 2) cannot listen: [Errno 98] "
        "address already in use", ["--claims-port"]),
    (5, "--state-dir x is busy", []),  # not a port: the test fails as before
    (3, "--port 4100: 127.0.0.1:4100 is already in use", []),
    (5, "--health-probe-port 4102: 127.0.0.1:4102 is already in use", []),  # not ours
])
def test_only_a_port_of_ours_that_was_taken_is_picked_again(
        code: int, said: str, taken: list[str]) -> None:
    assert port_taken(code, said, ["--port", "--claims-port"]) == taken


@pytest.mark.timeout(30)
def test_port_noise_takes_ports_only_in_its_ranges_and_gives_them_back() -> None:
    ranges = [(42000, 42009)]
    rng = random.Random(1)
    assert {pick(rng, ranges) for _ in range(50)} <= set(range(42000, 42010))
    assert run(0.3, 200.0, (0.001, 0.002), 4, ranges, host="127.0.0.1", seed=1) > 0
    for port in range(42000, 42010):  # all closed again
        sock = take(port, "127.0.0.1")
        assert sock is not None
        sock.close()
