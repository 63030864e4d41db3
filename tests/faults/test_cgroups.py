"""An engine is everything it forks: with a cgroup per engine, even a helper that left the
process group and cleared its environment (so neither the group nor the engine id finds it)
dies with a crash, with a stop, and after a crash that happened while no agent watched."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from engines.cgroups import EngineCgroups
from tests.faults.test_crashes import gone
from tests.harness import AgentProcess, wait_until
from tests.test_readoption import restart_agent

pytestmark = pytest.mark.integration
HIDDEN = "--sim-spawn-hidden="


@pytest.fixture
def cgroups_here(tmp_path: Path) -> Iterator[None]:
    """Skips where this machine lets no process create a cgroup v2 directory (the agent then
    falls back to the process group and the engine id, covered in test_crashes.py)."""
    probe, why = EngineCgroups.discover(str(tmp_path / "probe"))
    if probe is None:
        pytest.skip(f"no cgroup v2 directory can be created here: {why}")
    probe.remove_root()
    yield


def engine_cgroup(agent: AgentProcess, engine_id: str) -> EngineCgroups:
    cgroups, where = EngineCgroups.discover(str(agent.state_dir))
    assert cgroups is not None, where
    return cgroups


def hidden_helper(agent: AgentProcess, engine_id: str, leader: int) -> int:
    """The helper in the engine's cgroup; it carries neither the group nor the engine id."""
    cgroups = engine_cgroup(agent, engine_id)
    assert wait_until(lambda: len(cgroups.members(engine_id)) >= 2, 10), cgroups.members(engine_id)
    helper = next(pid for pid in cgroups.members(engine_id) if pid != leader)
    proc = psutil.Process(helper)
    assert "sim-engine-core-hidden" in " ".join(proc.cmdline())
    assert os.getsid(helper) != os.getsid(leader) and proc.environ() == {}
    return helper


def started(agent: AgentProcess) -> tuple[int, str, int]:
    first = agent.activate_sim("m1", HIDDEN)
    agent.wait_phase("m1", "active")
    engine_id = agent.model(agent.client.snapshot(), "m1")["engine_id"]
    return first["pid"], engine_id, hidden_helper(agent, engine_id, first["pid"])


def test_a_helper_outside_group_and_environment_dies_with_its_engines_crash(
        cgroups_here: None, agent: AgentProcess) -> None:
    leader, engine_id, helper = started(agent)
    os.kill(leader, signal.SIGKILL)
    assert wait_until(lambda: gone(helper), 15)
    snap = agent.wait_for(lambda s: agent.model(s, "m1")["phase"] == "active"
                          and agent.model(s, "m1")["restart_count"] == 1, what="restarted")
    new_leader = agent.model(snap, "m1")["pid"]
    assert new_leader in engine_cgroup(agent, engine_id).members(engine_id)


def test_a_stop_ends_the_whole_cgroup_and_removes_it(
        cgroups_here: None, agent: AgentProcess) -> None:
    leader, engine_id, helper = started(agent)
    agent.client.deactivate("m1")
    agent.wait_for(lambda s: not any(m["model_name"] == "m1" for m in s["models"])
                   or agent.model(s, "m1")["phase"] == "stopped", what="stopped")
    assert gone(leader) and gone(helper)
    assert wait_until(lambda: not engine_cgroup(agent, engine_id).path(engine_id).exists(), 10)


def test_a_crash_while_no_agent_watched_is_swept_at_the_next_start(
        cgroups_here: None, agent_factory: Callable[..., AgentProcess]) -> None:
    agent: AgentProcess = agent_factory()
    leader, engine_id, helper = started(agent)
    agent.kill()
    os.kill(leader, signal.SIGKILL)
    assert wait_until(lambda: gone(leader), 10)
    new = restart_agent(agent_factory, agent)
    assert wait_until(lambda: gone(helper), 15)
    new.wait_for(lambda s: new.model(s, "m1")["phase"] == "active"
                 and new.model(s, "m1")["pid"] != leader, what="restarted by the new agent")


def test_with_cgroups_off_the_engine_runs_where_the_agent_does(
        cgroups_here: None, agent_factory: Callable[..., AgentProcess]) -> None:
    agent: AgentProcess = agent_factory(extra_args=["--engine-cgroups", "off"])
    first = agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    assert Path(f"/proc/{first['pid']}/cgroup").read_text() == \
        Path(f"/proc/{agent.proc.pid}/cgroup").read_text()  # type: ignore[union-attr]
    assert "engine cgroups off" in agent.log_tail(200)
