"""Engine crashes, the restart budget, and isolation between engines."""

from __future__ import annotations

import os
import signal

import pytest

from tests.harness import AgentProcess
from tests.test_agent_lifecycle import complete

pytestmark = pytest.mark.integration


def test_a_crashing_engine_restarts_with_backoff_then_fails_with_its_log(
    agent_factory,
) -> None:
    agent: AgentProcess = agent_factory(restart_delays="0.1,0.2,0.4,0.8,1.6")
    steady = agent.activate_sim("steady")
    agent.wait_phase("steady", "active")
    flaky = agent.activate_sim("flaky", "--sim-crash-after=0.3", "--sim-crash-exit-code=3")
    model = agent.wait_phase("flaky", "failed", timeout_s=30)
    assert model["restart_count"] == 5
    assert model["pid"] is None and model["alive"] is False
    assert model["port"] == flaky["port"]
    assert "exited with code 3" in model["last_error"]
    assert "simulated crash" in model["last_error"]  # the tail of the engine's own log
    assert "restart budget" not in model["last_error"]
    events = [e for e in agent.client.events(0)["events"]
              if e["model"] == "flaky" and e["from"] != e["to"]]
    restarting = [e for e in events if e["to"] == "restarting"]
    booting = [e for e in events if e["to"] == "booting"]
    assert len(restarting) == 5 and len(booting) == 6
    # Each restart waits out its delay: booting i+1 comes >= delay i after restarting i.
    for delay, down, up in zip((0.1, 0.2, 0.4, 0.8, 1.6), restarting, booting[1:], strict=True):
        assert up["ts"] - down["ts"] >= delay * 0.95
    assert events[-1]["to"] == "failed" and events[-1]["reason"] == "RestartBudgetExhausted"
    # The other engine never noticed.
    other = agent.model(agent.client.snapshot(), "steady")
    assert other["phase"] == "active" and other["pid"] == steady["pid"]
    assert other["restart_count"] == 0
    assert complete(steady["port"], "steady")[0] == 200


def test_a_killed_engine_restarts_on_the_same_port(agent: AgentProcess) -> None:
    first = agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    os.kill(first["pid"], signal.SIGKILL)
    model = agent.wait_for(
        lambda s: agent.model(s, "m1")["phase"] == "active"
        and agent.model(s, "m1")["pid"] not in (None, first["pid"]),
        what="m1 restarted")
    m1 = agent.model(model, "m1")
    assert m1["port"] == first["port"] and m1["restart_count"] == 1
    assert m1["last_exit"].startswith("killed by signal SIGKILL")
    assert m1["last_error"] is None  # healthy again: the exit is history, not a current error
    assert complete(first["port"], "m1")[0] == 200


def test_a_sleeping_engine_that_crashes_comes_back_asleep(agent: AgentProcess) -> None:
    first = agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    agent.client.sleep("m1", 1)
    os.kill(first["pid"], signal.SIGKILL)
    snap = agent.wait_for(
        lambda s: agent.model(s, "m1")["pid"] not in (None, first["pid"])
        and agent.model(s, "m1")["phase"] == "sleeping" and agent.model(s, "m1")["operation"] is None,
        what="m1 restarted and asleep again")
    assert agent.model(snap, "m1")["desired"] == "asleep"
    assert complete(first["port"], "m1")[0] == 503


def test_a_crash_during_a_slow_sleep_answers_the_caller_at_once(agent: AgentProcess) -> None:
    import threading
    import time

    from runtime_agent.client import AgentError

    first = agent.activate_sim("m1", "--sim-sleep-seconds=30")
    agent.wait_phase("m1", "active")
    outcome: dict = {}

    def call() -> None:
        try:
            outcome["result"] = agent.client.sleep("m1")
        except AgentError as exc:
            outcome["error"] = exc

    caller = threading.Thread(target=call)
    caller.start()
    agent.wait_for(lambda s: agent.model(s, "m1")["operation"] == "sleep", what="sleep in flight")
    started = time.monotonic()
    os.kill(first["pid"], signal.SIGKILL)
    caller.join(10)
    assert not caller.is_alive() and time.monotonic() - started < 5
    # Either the exit (409) or the dropped connection (502) reaches the caller first.
    assert outcome["error"].status in (409, 502) and "result" not in outcome
    # A stop while a sleep is in flight is not held up by it either.
    agent.wait_for(lambda s: agent.model(s, "m1")["ready"]
                   and agent.model(s, "m1")["pid"] not in (None, first["pid"]), what="back")
    caller = threading.Thread(target=call)
    caller.start()
    agent.wait_for(lambda s: agent.model(s, "m1")["operation"] == "sleep", what="sleep again")
    assert agent.client.deactivate("m1")["phase"] == "stopped"
    caller.join(10)
    assert not caller.is_alive() and "being stopped" in str(outcome["error"])


def test_a_port_taken_by_another_process_is_waited_for_and_named(agent_factory) -> None:
    import socket

    agent: AgentProcess = agent_factory(restart_delays="3,0.05")
    first = agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    os.kill(first["pid"], signal.SIGKILL)
    agent.wait_phase("m1", "restarting")
    squatter = socket.socket()
    # SO_REUSEADDR: the port may still have TIME_WAIT connections the dead engine closed.
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # someone else takes the engine's port during the 3 s restart delay
        squatter.bind(("127.0.0.1", first["port"]))
        squatter.listen()
        snap = agent.wait_for(lambda s: "PortHeld" in agent.model(s, "m1")["conditions"],
                              timeout_s=20, what="the port held")
        model = agent.model(snap, "m1")
        assert f"port {first['port']} is held by another process" in model["last_error"]
        assert model["phase"] == "restarting" and model["restart_count"] == 1  # no budget spent
    finally:
        squatter.close()
    snap = agent.wait_for(lambda s: agent.model(s, "m1")["phase"] == "active", timeout_s=30,
                          what="started once the port was free")
    assert agent.model(snap, "m1")["restart_count"] == 1
