"""/metrics: the seed's names, every phase, figures that move with the lifecycle, promtool-clean."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import AgentProcess
from tests.test_readoption import restart_agent

pytestmark = pytest.mark.integration


def scrape(agent: AgentProcess) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[("aibrix:modelclaim_" + name, tuple(sorted(labels.items())))]


def test_metrics_follow_the_lifecycle_and_pass_promtool(agent_factory) -> None:
    agent: AgentProcess = agent_factory(restart_delays="0.05,0.05")
    agent.activate_sim("awake")
    agent.activate_sim("dozy")
    agent.activate_sim("doomed", "--sim-crash-after=0.2")
    agent.wait_phase("awake", "active")
    agent.wait_phase("dozy", "active")
    agent.client.sleep("dozy")
    agent.client.wake("dozy")
    agent.client.sleep("dozy")
    agent.wait_phase("doomed", "failed")
    text, samples = scrape(agent)
    assert value(samples, "models_resident") == 2
    for phase, count in {"active": 1, "sleeping": 1, "failed": 1, "booting": 0,
                         "restarting": 0, "stopping": 0}.items():
        assert value(samples, "engine_state", phase=phase) == count
    assert value(samples, "engine_restart_attempts_total", model="doomed") == 2
    assert value(samples, "engine_restart_budget_exhausted_total", model="doomed") == 1
    assert value(samples, "engine_restart_attempts_total", model="awake") == 0
    assert value(samples, "lifecycle_operations_total", model="dozy", action="sleep",
                 result="success") == 2
    assert value(samples, "lifecycle_operations_total", model="dozy", action="wake",
                 result="success") == 1
    assert value(samples, "lifecycle_operation_duration_seconds_count", model="dozy",
                 action="sleep", result="success") == 2
    assert value(samples, "lifecycle_operation_duration_seconds_count", model="dozy",
                 action="wake", result="success") == 1
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: install Debian's prometheus package"
    check = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                           capture_output=True, timeout=30)
    # The seed's metric names contain ':' (the dashboards' contract); promtool's linter reserves
    # ':' for recording rules and says so for each family. Any other finding fails the test.
    findings = [line for line in (check.stdout + check.stderr).decode().splitlines()
                if line.strip() and not line.endswith("metric names should not contain ':'")]
    assert check.returncode in (0, 3) and findings == [], findings

    # Counters the registry holds survive an agent restart; re-adoptions are counted.
    new = restart_agent(agent_factory, agent)
    new.wait_for(lambda s: all(m["adopted"] or m["phase"] == "failed" for m in s["models"]),
                 what="re-adopted")
    _, after = scrape(new)
    assert value(after, "lifecycle_operations_total", model="dozy", action="sleep",
                 result="success") == 2
    assert value(after, "engine_restart_attempts_total", model="doomed") == 2
    assert value(after, "engine_re_adoptions_total", result="adopted") == 2
    assert value(after, "engine_re_adoptions_total", result="failed") == 1


def test_a_crash_moves_the_restart_counter_and_resident_count(agent: AgentProcess) -> None:
    pid = agent.activate_sim("m1")["pid"]
    agent.wait_phase("m1", "active")
    _, before = scrape(agent)
    assert value(before, "models_resident") == 1
    os.kill(pid, signal.SIGKILL)
    agent.wait_for(lambda s: agent.model(s, "m1")["restart_count"] == 1
                   and agent.model(s, "m1")["ready"], what="restarted")
    _, after = scrape(agent)
    assert value(after, "engine_restart_attempts_total", model="m1") == 1
    agent.client.deactivate("m1")
    _, gone = scrape(agent)
    assert value(gone, "models_resident") == 0


# From AIBrix's runtime dashboard (vllm-project/aibrix,
# observability/grafana/AIBrix_ModelClaim_Runtime_Dashboard.json, panels "Sleep / Wake Outcomes
# / s" and "Sleep / Wake Average Duration"): both filter by model=~"$model" and group by these
# labels; pod comes from the scrape (its ServiceMonitor), the rest from the agent.
AIBRIX_LIFECYCLE_GROUP = ("model", "pod", "action", "result")
AIBRIX_LIFECYCLE_FAMILIES = ("aibrix:modelclaim_lifecycle_operations_total",
                             "aibrix:modelclaim_lifecycle_operation_duration_seconds_sum",
                             "aibrix:modelclaim_lifecycle_operation_duration_seconds_count")


def test_sleep_and_wake_durations_carry_the_labels_aibrixs_dashboard_selects(
    agent: AgentProcess,
) -> None:
    agent.activate_sim("dozy")
    agent.activate_sim("awake")
    agent.wait_phase("dozy", "active")
    agent.wait_phase("awake", "active")
    agent.client.sleep("dozy", 1)
    agent.client.wake("dozy")
    _, samples = scrape(agent)
    agent_labels = set(AIBRIX_LIFECYCLE_GROUP) - {"pod"}
    for family in AIBRIX_LIFECYCLE_FAMILIES:
        series = [dict(labels) for name, labels in samples if name == family]
        assert series and all(set(s) == agent_labels for s in series), (family, series)
        # With model "dozy" picked, each panel has a series per action and result.
        picked = {(s["action"], s["result"]) for s in series if s["model"] == "dozy"}
        assert picked == {("sleep", "success"), ("wake", "success")}, (family, series)
        assert not any(s["model"] == "awake" for s in series if "duration" in family)
    # A stopped model's series go with it, as its counters do.
    agent.client.deactivate("dozy")
    _, after = scrape(agent)
    assert not any(dict(labels).get("model") == "dozy" for name, labels in after
                   if name.startswith("aibrix:modelclaim_lifecycle_operation"))
