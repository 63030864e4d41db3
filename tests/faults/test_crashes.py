"""Crashes, of the agent and of engines, injected into real processes: what the agent reports
afterwards is what is, and nothing of a dead engine survives it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest

from registry.identity import scan_engines
from registry.env import ENV_ENGINE_ID
from runtime_agent.client import AgentError
from tests.harness import AgentProcess, wait_until
from tests.test_readoption import restart_agent

pytestmark = pytest.mark.integration
GiB = 1 << 30
PROBES = ("--health-interval", "0.2")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def carrying(agent: AgentProcess, engine_id: str) -> list[int]:
    return [f.pid for f in scan_engines(str(agent.state_dir), every=True)
            if f.environ[ENV_ENGINE_ID] == engine_id]


@pytest.mark.parametrize(("call", "before", "after", "knob"), [
    ("sleep", "active", "sleeping", "--sim-sleep-seconds=2"),
    ("wake", "sleeping", "active", "--sim-wake-seconds=2")])
def test_an_agent_killed_mid_call_reports_what_the_engine_did_after_its_restart(
        agent_factory, call: str, before: str, after: str, knob: str) -> None:
    agent: AgentProcess = agent_factory(extra_args=PROBES)
    pid = agent.activate_sim("m1", knob)["pid"]
    agent.wait_phase("m1", "active")
    if call == "wake":
        agent.client.sleep("m1")
    started = threading.Thread(target=lambda: _quietly(getattr(agent.client, call), "m1"))
    started.start()
    # An operation starts without an event: poll for it.
    agent.wait_for(lambda s: agent.model(s, "m1")["operation"] == call, what="call in flight",
                   poll_s=0.05)
    said = "Putting the engine to sleep" if call == "sleep" else "wake up the engine"
    assert wait_until(lambda: agent.engine_said(said), 10)  # the call reached the engine
    agent.kill()  # mid-call: the engine finishes it with no agent to see
    started.join(10)
    new = restart_agent(agent_factory, agent)
    snap = new.wait_for(lambda s: new.model(s, "m1")["phase"] == after, timeout_s=15,
                        what=f"{after}, as the engine says")
    model = new.model(snap, "m1")
    assert model["pid"] == pid and model["ready"] is (after == "active")
    assert model["desired"] == ("asleep" if after == "sleeping" else "awake")
    undo = new.client.wake("m1") if after == "sleeping" else new.client.sleep("m1")
    assert undo["applied"] is True and undo["phase"] == before  # a real call, not a no-op


def test_a_sleep_the_engine_finished_while_no_agent_watched_is_asleep_in_every_snapshot(
        agent_factory) -> None:
    """The new agent found the engine asleep at its first look and moved to `sleeping` before
    it settled the call the old agent left in flight: the snapshot said `sleeping` with
    `desired: awake` until the next health probe."""
    agent: AgentProcess = agent_factory(extra_args=PROBES)
    agent.activate_sim("m1", "--sim-sleep-seconds=1")
    port = agent.wait_phase("m1", "active")["port"]
    call = threading.Thread(target=lambda: _quietly(agent.client.sleep, "m1"))
    call.start()
    agent.wait_for(lambda s: agent.model(s, "m1")["operation"] == "sleep", what="in flight",
                   poll_s=0.05)
    # The record says "sleep" before the call goes out (nothing is sent before its record is
    # written): on a loaded machine the kill could come in between, and no sleep would ever
    # reach the engine. Kill once the engine has begun it.
    assert wait_until(lambda: agent.engine_said("Putting the engine to sleep"), 10)
    agent.kill()
    call.join(10)
    assert wait_until(lambda: _engine_asleep(port), 10), "the engine never finished its sleep"
    new = restart_agent(agent_factory, agent)
    snap = new.wait_for(lambda s: new.model(s, "m1")["phase"] == "sleeping", timeout_s=15,
                        what="asleep, as the engine says")
    model = new.model(snap, "m1")
    assert (model["desired"], model["operation"], model["sleep_level"]) == ("asleep", None, 1)


def _engine_asleep(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/is_sleeping", timeout=2) as resp:
            return bool(json.loads(resp.read())["is_sleeping"])
    except OSError:
        return False


def _quietly(call, *args) -> None:  # type: ignore[no-untyped-def]
    try:
        call(*args)
    except (AgentError, OSError):
        pass  # the agent died under the call


def test_a_dead_leaders_orphaned_worker_is_killed_not_adopted(agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    first = agent.activate_sim("m1", "--sim-spawn-child=")
    agent.wait_phase("m1", "active")
    engine_id = agent.model(agent.client.snapshot(), "m1")["engine_id"]
    worker = next(p for p in carrying(agent, engine_id) if p != first["pid"])
    agent.kill()
    os.kill(first["pid"], signal.SIGKILL)  # the API server dies with no agent watching
    assert wait_until(lambda: gone(first["pid"]), 10) and not gone(worker)
    new = restart_agent(agent_factory, agent)
    snap = new.wait_for(lambda s: new.model(s, "m1")["phase"] == "active"
                        and new.model(s, "m1")["pid"] not in (None, first["pid"], worker),
                        timeout_s=20, what="restarted, not the orphan adopted")
    assert wait_until(lambda: gone(worker), 10)
    assert new.model(snap, "m1")["restart_count"] == 1
    assert new.client.deactivate("m1")["phase"] == "stopped"  # and it stops in bounded time


def test_a_worker_that_dies_while_the_api_server_lives_is_a_crash(agent: AgentProcess) -> None:
    first = agent.activate_sim("m1", "--sim-spawn-child=")
    agent.wait_phase("m1", "active")
    engine_id = agent.model(agent.client.snapshot(), "m1")["engine_id"]
    worker = next(p for p in carrying(agent, engine_id) if p != first["pid"])
    os.kill(worker, signal.SIGKILL)
    snap = agent.wait_for(lambda s: agent.model(s, "m1")["restart_count"] == 1
                          and agent.model(s, "m1")["phase"] == "active", timeout_s=20,
                          what="restarted")
    assert agent.model(snap, "m1")["pid"] != first["pid"] and gone(first["pid"])
    events = [e for e in agent.client.events(0)["events"] if e["to"] == "restarting"]
    assert "worker" in events[0]["message"] and str(worker) in events[0]["message"]


def test_a_helper_that_left_the_group_dies_with_a_crash(agent: AgentProcess) -> None:
    first = agent.activate_sim("m1", "--sim-spawn-escaped=")
    agent.wait_phase("m1", "active")
    engine_id = agent.model(agent.client.snapshot(), "m1")["engine_id"]
    assert wait_until(lambda: len(carrying(agent, engine_id)) == 2, 10)
    helper = next(p for p in carrying(agent, engine_id) if p != first["pid"])
    assert os.getsid(helper) != os.getsid(first["pid"])  # it left the engine's session
    os.kill(first["pid"], signal.SIGKILL)
    assert wait_until(lambda: gone(helper), 15)
    agent.wait_for(lambda s: agent.model(s, "m1")["phase"] == "active"
                   and agent.model(s, "m1")["restart_count"] == 1, what="restarted")


def test_a_lost_record_is_rebuilt_with_its_cards_limits_and_sleep(agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    first = agent.activate_sim("m1", kv_limit_bytes=GiB, per_gpu={
        "maximum_footprint_bytes": 4 * GiB, "kv_floor_bytes": GiB})
    agent.wait_phase("m1", "active")
    agent.client.sleep("m1", 2)
    engine_id = agent.model(agent.client.snapshot(), "m1")["engine_id"]
    agent.kill()
    (agent.state_dir / "engines" / f"{engine_id}.json").unlink()
    new = restart_agent(agent_factory, agent)
    snap = new.wait_for(lambda s: new.model(s, "m1")["phase"] == "sleeping", what="rebuilt")
    model = new.model(snap, "m1")
    assert model["pid"] == first["pid"] and model["devices"] == [0]
    assert model["kv_limit_requested_bytes"] == GiB and model["desired"] == "asleep"
    assert model["sleep_level"] == 2  # woken later as a level-2 sleeper: weights reloaded


def test_a_record_with_a_value_this_agent_does_not_know_never_stops_the_agent(
        agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    first = agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    engine_id = agent.model(agent.client.snapshot(), "m1")["engine_id"]
    agent.kill()
    path = agent.state_dir / "engines" / f"{engine_id}.json"
    data = json.loads(path.read_text())
    data["phase"] = "hibernating"  # from a newer agent, or a hand edit
    path.write_text(json.dumps(data))
    new = restart_agent(agent_factory, agent)
    snap = new.wait_for(lambda s: new.model(s, "m1")["phase"] == "active", what="taken over")
    assert new.model(snap, "m1")["pid"] == first["pid"]  # rebuilt from the engine itself
    assert list((agent.state_dir / "corrupt").iterdir())  # the bad file kept for a human


def test_deactivate_ends_within_the_grace_and_a_bounded_kill(agent_factory) -> None:
    agent: AgentProcess = agent_factory()  # --stop-grace 3
    first = agent.activate_sim("m1", "--sim-stop-seconds=60")  # ignores SIGTERM for a minute
    agent.wait_phase("m1", "active")
    began = time.monotonic()
    assert agent.client.deactivate("m1")["phase"] == "stopped"
    assert time.monotonic() - began < 3 + 10 + 5 and gone(first["pid"])
    assert list((agent.state_dir / "engines").glob("*.json")) == []
