"""Hung engines and a starved agent, injected into real processes: alive is not enough, and the
agent's own loops outlive a fault that passes."""

from __future__ import annotations

import os
import resource
import signal
import threading
import time

import psutil
import pytest

from runtime_agent.client import AgentError
from runtime_agent.kv.segment import read_segment, write_limit
from tests.harness import AgentProcess, wait_until

pytestmark = pytest.mark.integration
GiB = 1 << 30
QUICK = ("--health-interval", "0.2", "--unresponsive-after", "3", "--unresponsive-grace", "2")


def test_a_stopped_engine_is_not_ready_then_restarted_and_calls_to_it_answer(
        agent_factory) -> None:
    agent: AgentProcess = agent_factory(extra_args=QUICK)
    first = agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    os.kill(first["pid"], signal.SIGSTOP)  # the shape of a deadlock: alive, answers nothing
    try:
        snap = agent.wait_for(lambda s: "EngineUnresponsive" in agent.model(s, "m1")["conditions"],
                              timeout_s=20, what="unresponsive")  # steady: probed every 2 s
        assert agent.model(snap, "m1")["ready"] is False
        answered: list[object] = []

        def sleep() -> None:
            try:
                answered.append(agent.client.sleep("m1"))
            except AgentError as exc:
                answered.append(exc.status)

        caller = threading.Thread(target=sleep)
        caller.start()
        snap = agent.wait_for(lambda s: agent.model(s, "m1")["restart_count"] == 1
                              and agent.model(s, "m1")["phase"] == "active", timeout_s=20,
                              what="restarted")
        caller.join(20)
        assert answered, "the sleep call to a stopped engine never answered"
        assert agent.model(snap, "m1")["pid"] != first["pid"]
        assert any("unresponsive" in e["message"] for e in agent.client.events(0)["events"])
    finally:
        try:
            os.kill(first["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert wait_until(lambda: not psutil.pid_exists(first["pid"])
                      or psutil.Process(first["pid"]).status() == psutil.STATUS_ZOMBIE, 10)


def test_kv_holding_outlives_a_spell_without_file_descriptors(agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    agent.activate_sim("m1", kv_limit_bytes=GiB)
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_limit_applied_bytes"] == GiB, what="set")
    assert agent.proc is not None
    pid = agent.proc.pid
    log_before = agent.log_path.stat().st_size
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    in_use = len(os.listdir(f"/proc/{pid}/fd"))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use, hard))  # no descriptor to spare
    try:
        time.sleep(3)  # the fault lasts a few seconds: the KV watcher fails meanwhile
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    write_limit("kvc_m1", 3 * GiB // 2, agent.shm_dir)  # someone else writes the segment
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_limit_set_back_total"] >= 1,
                   timeout_s=20, what="the limit held again")
    assert read_segment("kvc_m1", agent.shm_dir).total_size == GiB
    grew = agent.log_path.stat().st_size - log_before
    assert grew < 64 * 1024, f"the agent log grew by {grew} bytes during a 3 s fault"
