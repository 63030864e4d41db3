"""Idle cost that follows change, against the real agent and simulated engines: a steady engine
is probed less and less often, any change brings the fast pace back, and a hung engine is still
found within the bound the README states (cap + timeout + (misses - 1) x (floor + timeout))."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from tests.harness import AgentProcess, http_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
FLOOR_S, BACKOFF = 0.05, 40  # health probes every 50 ms after a change, up to every 2 s
CAP_S = FLOOR_S * BACKOFF
PROBE_TIMEOUT_S = 2.0  # the agent's probe timeout (Settings.probe_timeout_s)
MISSES = 3
ARGS = ("--health-interval", str(FLOOR_S), "--steady-backoff", str(BACKOFF),
        "--unresponsive-after", str(MISSES), "--unresponsive-grace", "60")
PROBES = ("/is_sleeping", "/health")


def probes(port: int) -> int:
    """The health probes the simulated engine has answered (it counts its requests by path)."""
    status, body = http_json(f"http://127.0.0.1:{port}/sim/state", timeout=10)
    assert status == 200, body
    seen: dict[str, int] = body["requests_seen"]
    return sum(seen.get(path, 0) for path in PROBES)


def probes_over(port: int, seconds: float) -> int:
    before = probes(port)
    time.sleep(seconds)  # a rate is counted over a window: the window is the measurement
    return probes(port) - before


def started(agent: AgentProcess, name: str) -> dict[str, Any]:
    agent.activate_sim(name)
    return agent.wait_phase(name, "active")


def test_a_steady_engine_is_probed_less_often_and_a_transition_brings_the_fast_pace_back(
        agent_factory) -> None:
    agent: AgentProcess = agent_factory(extra_args=ARGS)
    port = started(agent, "m1")["port"]
    probes_over(port, 4.0)  # quiet: the interval doubles up to the 2 s cap meanwhile
    steady = probes_over(port, 8.0)
    # At the cap, one probe per 2 s (one more at each edge of the window); a fixed 50 ms
    # interval would have answered 160.
    assert 1 <= steady <= 6, steady
    agent.client.sleep("m1")
    agent.wait_phase("m1", "sleeping")  # a transition: the fast pace again
    after = probes_over(port, 2.0)
    # From the floor, doubling: 0.05 + 0.1 + 0.2 + 0.4 + 0.8 s: 5 probes within one cap
    # interval, where a steady engine gets one.
    assert after >= 4, (steady, after)


def test_a_hung_engine_is_found_within_the_bound_however_long_it_was_steady(
        agent_factory) -> None:
    agent: AgentProcess = agent_factory(extra_args=ARGS)
    engine = started(agent, "m1")
    probes_over(engine["port"], 3 * CAP_S)  # steady: probed at the cap
    cursor = agent.client.events(0)["cursor"]
    stopped_at = time.time()
    os.kill(engine["pid"], signal.SIGSTOP)  # alive, answers nothing: no exit to notice
    try:
        snap = agent.wait_for(
            lambda s: "EngineUnresponsive" in agent.model(s, "m1")["conditions"],
            timeout_s=30, what="the hung engine unresponsive")
        assert agent.model(snap, "m1")["ready"] is False
        found = [e for e in agent.client.events(cursor)["events"]
                 if e["reason"] == "EngineUnresponsive"]
        assert found and "3 health probes in a row" in found[0]["message"]
        bound = CAP_S + PROBE_TIMEOUT_S + (MISSES - 1) * (FLOOR_S + PROBE_TIMEOUT_S)
        # The event's own time against the bound, with a margin for a loaded machine.
        assert found[0]["ts"] - stopped_at <= bound + 3.0, found[0]["ts"] - stopped_at
    finally:
        os.kill(engine["pid"], signal.SIGCONT)
    agent.wait_for(lambda s: not agent.model(s, "m1")["conditions"], timeout_s=30,
                   what="responsive again")
