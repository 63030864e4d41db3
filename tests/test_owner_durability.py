"""What the agent does when its own ground moves: an engine's leader that died while no agent
watched, a state directory that cannot be written, and callers that race each other. Each is
injected into real agent and engine processes."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest

from runtime_agent.client import AgentError
from tests.faults.test_crashes import carrying, gone
from tests.harness import AgentProcess, port_is_open, wait_until
from tests.test_readoption import restart_agent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def test_an_engine_whose_leader_died_while_the_agent_was_down_is_restarted_not_its_helper(
        agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    first = agent.activate_sim("m1", "--sim-spawn-escaped=")
    agent.wait_phase("m1", "active")
    engine_id = agent.model(agent.client.snapshot(), "m1")["engine_id"]
    assert wait_until(lambda: len(carrying(agent, engine_id)) == 2, 10)
    helper = next(p for p in carrying(agent, engine_id) if p != first["pid"])
    assert os.getsid(helper) == helper  # it leads a session of its own, as an engine does
    agent.kill()
    os.kill(first["pid"], signal.SIGKILL)  # the leader alone: its helper lives on
    assert wait_until(lambda: gone(first["pid"]), 10) and not gone(helper)
    new = restart_agent(agent_factory, agent)
    snap = new.wait_for(lambda s: new.model(s, "m1")["ready"]
                        and new.model(s, "m1")["pid"] not in (None, first["pid"], helper),
                        timeout_s=20, what="m1 restarted, not its helper adopted")
    model = new.model(snap, "m1")
    assert model["restart_count"] == 1 and not model["adopted"]
    assert port_is_open(model["port"])
    assert wait_until(lambda: gone(helper), 10)  # the helper alone is no engine: it is ended


def _answer(call: Callable[[], dict[str, Any]]) -> tuple[int, str]:
    try:
        return 200, str(call().get("phase"))
    except AgentError as exc:
        return exc.status, str(exc)


def test_an_activation_stopped_by_a_concurrent_deactivate_is_a_409_not_an_engine_failure(
        agent: AgentProcess) -> None:
    answers: list[tuple[int, str]] = []
    for round_ in range(15):  # bounded: each round is one activation raced by deactivates
        done = threading.Event()

        def stop_while_starting() -> None:
            while not done.is_set():
                answers.append(_answer(lambda: agent.client.deactivate("m1")))

        stopper = threading.Thread(target=stop_while_starting)
        stopper.start()
        try:
            answers.append(_answer(lambda: agent.activate_sim("m1")))
            answers.append(_answer(lambda: agent.activate_sim("m1")))  # joins, or starts anew
        finally:
            done.set()
            stopper.join(30)
    assert _answer(lambda: agent.client.deactivate("m1"))[0] == 200
    server_errors = [a for a in answers if a[0] >= 500]
    assert server_errors == [], f"a caller's race answered as an engine failure: {server_errors}"
    races = [message for status, message in answers if status == 409]
    assert races and all("deactivated by another request" in m for m in races), races
    assert agent.client.snapshot()["models"] == []
