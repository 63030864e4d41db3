"""What the agent does when its own ground moves: an engine's leader that died while no agent
watched, a state directory that cannot be written, and callers that race each other. Each is
injected into real agent and engine processes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime_agent.client import AgentError
from tests.artifact_peers import tmpfs
from tests.faults.test_crashes import carrying, gone
from tests.faults.test_storage import fill, read_only, record_settled, sim_gpu_apart
from tests.harness import AgentProcess, http_json, port_is_open, wait_until
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
    # Each round is one activation raced by deactivates. The race's window is short (from the
    # record's write to the spawn), so 15 rounds may miss it on a loaded machine (a fresh
    # clone's suite did): go on, up to 45 s, until it was hit at least once.
    rounds, deadline = 0, time.monotonic() + 45

    def raced() -> bool:
        return any(status == 409 for status, _ in answers)

    while rounds < 15 or not raced() and time.monotonic() < deadline:
        rounds += 1
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


def engine_sleeping(port: int) -> bool:
    status, body = http_json(f"http://127.0.0.1:{port}/is_sleeping")
    assert status == 200, body
    return bool(body["is_sleeping"])


def test_a_sleep_whose_record_cannot_be_written_is_never_sent_to_the_engine(
        agent_factory, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "4m") as disk, sim_gpu_apart(disk / "state"):
        agent: AgentProcess = agent_factory(state_dir=disk / "state", shm_dir=tmp_path / "shm")
        first = agent.activate_sim("m1")
        agent.wait_phase("m1", "active")
        assert wait_until(lambda: record_settled(disk / "state", "active"), 10)
        filler = fill(disk)  # no write has failed yet: the agent learns it from this sleep
        with pytest.raises(AgentError) as err:
            agent.client.sleep("m1", 1)
        assert err.value.status == 503 and "state directory" in str(err.value)
        assert err.value.body["applied"] is False
        assert not engine_sleeping(first["port"])  # the engine stays as it was
        model = agent.model(agent.client.snapshot(), "m1")
        assert model["phase"] == "active" and model["operation"] is None
        assert "StorageUnavailable" in model["conditions"]
        filler.unlink()
        agent.wait_for(lambda s: "StorageUnavailable" not in agent.model(s, "m1")["conditions"],
                       what="the record written again")
        assert agent.client.sleep("m1", 1)["phase"] == "sleeping"  # written, then sent
        assert engine_sleeping(first["port"])


def test_a_stop_on_a_read_only_state_directory_is_made_and_never_undone_by_a_restarted_agent(
        agent_factory, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "8m") as disk:
        agent: AgentProcess = agent_factory(state_dir=disk / "state")
        first = agent.activate_sim("m1", "--sim-spawn-escaped=")
        agent.wait_phase("m1", "active")
        engine_id = agent.model(agent.client.snapshot(), "m1")["engine_id"]
        assert wait_until(lambda: len(carrying(agent, engine_id)) == 2, 10)
        assert wait_until(lambda: record_settled(disk / "state", "active"), 10)
        records = disk / "state" / "engines"
        record = records / f"{engine_id}.json"
        marker = agent.shm_dir / f"{engine_id}.stopped"
        with read_only(records):
            assert agent.client.deactivate("m1")["phase"] == "stopped"
            assert carrying(agent, engine_id) == [] and not port_is_open(first["port"])
            assert json.loads(record.read_text())["phase"] == "active"  # stale, and kept
            assert marker.exists()
            # A restarted agent finds the stale record: the engine must not come back, and
            # nothing that runs is taken for it.
            again = restart_agent(agent_factory, agent)
            snap = again.wait_for(lambda s: all(m["phase"] == "stopped" for m in s["models"]),
                                  what="the stop finished, nothing started")
            assert [m["pid"] for m in snap["models"]] in ([], [None])
            moves = [e["to"] for e in again.client.events(0)["events"]]
            assert not {"booting", "restarting"} & set(moves), moves  # nothing started
            assert carrying(again, engine_id) == [] and not port_is_open(first["port"])
        # Writable again: the next agent removes the record and its marker for good.
        last = restart_agent(agent_factory, again)
        assert wait_until(lambda: not record.exists() and not marker.exists(), 15)
        last.wait_for(lambda s: s["models"] == [], what="the finished stop out of the list")
        assert carrying(last, engine_id) == []
        last.activate_sim("m1")  # and the name is free for a new engine
        last.wait_phase("m1", "active")


def test_an_agent_killed_as_its_engine_restarts_keeps_how_the_engine_ended(
        agent_factory) -> None:
    """The view said `restarting` before the record did (the log tail and the leftover sweep
    came first): an agent SIGKILLed in that gap left the old pid on disk, and the next agent
    wrote "its process was gone when the agent started" over the real exit."""
    agent: AgentProcess = agent_factory(restart_delays="30,30,30,30,30")
    agent.activate_sim("m1")
    pid = agent.wait_phase("m1", "active")["pid"]
    os.kill(pid, signal.SIGKILL)
    agent.wait_for(lambda s: agent.model(s, "m1")["phase"] == "restarting", timeout_s=10,
                   what="m1 restarting")
    new = restart_agent(agent_factory, agent)  # at once: SIGKILL, as a node's OOM killer does
    model = new.wait_for(lambda s: new.model(s, "m1")["phase"] in ("restarting", "booting",
                                                                  "active"),
                         what="m1 taken over").get("models")[0]
    assert "SIGKILL" in (model["last_exit"] or ""), model["last_exit"]
