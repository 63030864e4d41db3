"""An engine that loses its port to another process between the agent's check and its own bind.

The agent checks that an engine's port is free before it starts the engine, and the engine
binds it only once its model is loaded (vLLM, SGLang and the simulator all do); a stranger that
takes the port meanwhile made the engine exit "address already in use", which the agent
counted as a crash: a restart from the budget of five, for a fault that is not the engine's.
It is a ``PortHeld`` wait instead, as when the port is held at the start.
"""

from __future__ import annotations

import socket

import pytest

from contract.reasons import PORT_HELD
from runtime_agent.supervision.ports import lost_its_port
from tests.harness import AgentProcess


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_an_engine_whose_port_is_taken_before_it_binds_waits_for_it_without_spending_a_restart(
        agent: AgentProcess) -> None:
    started = agent.activate_sim("m", "--sim-startup-seconds=1.0")
    stranger = socket.socket()
    stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    stranger.bind(("0.0.0.0", started["port"]))  # taken while the model loads
    stranger.listen(1)
    try:
        held = agent.wait_for(lambda snap: PORT_HELD in agent.model(snap, "m")["conditions"],
                              30, "PortHeld")
        assert agent.model(held, "m")["restart_count"] == 0
    finally:
        stranger.close()
    ready = agent.wait_phase("m", "active", timeout_s=40)
    assert ready["restart_count"] == 0 and ready["port"] == started["port"]
    assert PORT_HELD not in ready["conditions"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("line", "lost"), [
    ("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 20001): "
     "address already in use", True),
    ("Error: listen tcp 127.0.0.1:20001: bind: address already in use", True),
    ('  File ".../vllm/entrypoints/launchers/launcher.py", line 348, in create_server_socket\n'
     "OSError: [Errno 98] Address already in use", True),  # vLLM: its API socket, unnamed
    ("[Errno 98] error while attempting to bind on address ('127.0.0.1', 200011): "
     "address already in use", False),  # another port that only contains ours
    ("torch.distributed: port 29500: address already in use", False),  # not its own port
    ("INFO: Uvicorn running on http://127.0.0.1:20001", False),
])
def test_only_a_bind_failure_on_the_engines_own_port_is_a_lost_port(line: str, lost: bool) -> None:
    assert lost_its_port(["INFO: Started server process [7]", *line.split("\n")], 20001) is lost
