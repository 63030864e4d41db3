"""A restarted agent takes its engines back: same PID, same port, no restart, nothing lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from registry.identity import process_start_time
from tests.harness import AgentProcess
from tests.test_agent_lifecycle import complete

pytestmark = pytest.mark.integration


def restart_agent(agent_factory, old: AgentProcess) -> AgentProcess:
    old.kill()
    new = agent_factory(state_dir=old.state_dir, start=False)
    new.port_low, new.port_high = old.port_low, old.port_high
    new.start()
    return new


def test_a_killed_agent_is_replaced_and_readopts_every_engine(agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    for name in ("a", "b", "c"):
        agent.activate_sim(name)
    # Read once active: under load the activation can answer before the engine has a pid.
    before = {name: agent.wait_phase(name, "active") for name in ("a", "b", "c")}
    agent.client.sleep("c", 1)
    new = restart_agent(agent_factory, agent)
    snap = new.wait_for(lambda s: all(m["phase"] in ("active", "sleeping") and m["adopted"]
                                      and (m["ready"] or m["phase"] == "sleeping")
                                      for m in s["models"]) and len(s["models"]) == 3,
                        what="all engines re-adopted")
    for name, first in before.items():
        model = new.model(snap, name)
        assert (model["pid"], model["port"], model["restart_count"]) == \
            (first["pid"], first["port"], 0)
    assert new.model(snap, "c")["phase"] == "sleeping"
    assert complete(before["a"]["port"], "a")[0] == 200
    # A re-adopted engine is still watched: its crash is seen and it restarts on its port.
    os.kill(before["a"]["pid"], signal.SIGKILL)
    model = new.model(new.wait_for(
        lambda s: new.model(s, "a")["restart_count"] == 1 and new.model(s, "a")["ready"],
        what="a restarted"), "a")
    assert model["port"] == before["a"]["port"]
    assert "status unknown" in model["last_exit"] and model["last_error"] is None


def test_an_engine_that_died_with_the_agent_is_restarted_on_its_port(agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    first = agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    agent.kill()
    os.killpg(first["pid"], signal.SIGKILL)
    new = restart_agent(agent_factory, agent)
    model = new.model(new.wait_for(lambda s: new.model(s, "m1")["ready"], what="m1 back"), "m1")
    assert model["port"] == first["port"] and model["pid"] != first["pid"]
    assert model["restart_count"] == 1


def test_a_truncated_registry_file_loses_no_running_engine(agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    first = agent.activate_sim("m1")
    agent.activate_sim("m2")
    agent.wait_phase("m1", "active")
    agent.wait_phase("m2", "active")
    agent.kill()
    files = {json.loads(p.read_text())["spec"]["model_name"]: p
             for p in (agent.state_dir / "engines").glob("*.json")}
    data = files["m1"].read_bytes()
    files["m1"].write_bytes(data[: len(data) // 2])  # as if cut off mid-write
    new = restart_agent(agent_factory, agent)
    snap = new.wait_for(lambda s: len(s["models"]) == 2 and all(m["ready"] for m in s["models"]),
                        what="both engines back")
    m1 = new.model(snap, "m1")
    assert (m1["pid"], m1["port"], m1["restart_count"]) == (first["pid"], first["port"], 0)
    kept = list((agent.state_dir / "corrupt").iterdir())
    assert len(kept) == 1 and kept[0].read_bytes() == data[: len(data) // 2]
    # The rebuilt record is durable again.
    names = {json.loads(p.read_text())["spec"]["model_name"]
             for p in (agent.state_dir / "engines").glob("*.json")}
    assert names == {"m1", "m2"}


def test_a_reused_pid_is_never_adopted(agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    first = agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    agent.kill()
    os.killpg(first["pid"], signal.SIGKILL)
    # An unrelated process now "has" the engine's PID: point the record at it.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                start_new_session=True)
    try:
        path = next((agent.state_dir / "engines").glob("*.json"))
        record = json.loads(path.read_text())
        record["pid"] = stranger.pid
        record["pid_start_time"] = process_start_time(stranger.pid)
        path.write_text(json.dumps(record))
        new = restart_agent(agent_factory, agent)
        model = new.model(new.wait_for(lambda s: new.model(s, "m1")["ready"], what="m1"), "m1")
        assert model["pid"] not in (stranger.pid, first["pid"])
        assert model["restart_count"] == 1 and model["adopted"] is False
        time.sleep(0.2)
        assert stranger.poll() is None  # untouched
        new.client.deactivate("m1")
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_a_stale_record_with_a_recycled_start_time_is_not_adopted(agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    first = agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    agent.kill()
    path = next((agent.state_dir / "engines").glob("*.json"))
    record = json.loads(path.read_text())
    record["pid_start_time"] = record["pid_start_time"] - 1  # same PID, another process
    path.write_text(json.dumps(record))
    new = restart_agent(agent_factory, agent)
    # The process still carries the engine id, so the scan finds and verifies it instead.
    model = new.model(new.wait_for(lambda s: new.model(s, "m1")["ready"], what="m1"), "m1")
    assert model["pid"] == first["pid"] and model["restart_count"] == 0
    assert psutil.Process(first["pid"]).is_running()


def test_an_operation_id_answers_its_first_result_after_an_agent_restart(agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    first = agent.client.sleep("m1", 1, operation_id="sleep-42")
    agent.client.wake("m1")
    new = restart_agent(agent_factory, agent)
    new.wait_for(lambda s: new.model(s, "m1")["ready"], what="re-adopted and awake")
    cursor = new.client.events(0)["cursor"]
    again = new.client.sleep("m1", 1, operation_id="sleep-42")  # answered, not slept again
    assert again == {**first, "applied": False, "phase": "active"}
    assert new.model(new.client.snapshot(), "m1")["phase"] == "active"
    assert new.client.events(0)["cursor"] == cursor
