"""AIBrix's own runtime dashboard, with a model picked, finds data in a real Prometheus (issue 22).

A real Prometheus scrapes a real agent with two models, one asleep; each query of AIBrix's
ModelClaim runtime dashboard that reads the agent's series is run as the dashboard runs it
(variables filled in as Grafana would, the dashboard's ``or vector(0)`` fallbacks taken off so
that an empty answer shows) and must return at least one series. The lifecycle duration had an
``action`` label only, so its panel was empty once a model was picked.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.harness import AgentProcess, free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# The queries of the panels that read the agent's (aibrix:) series, as written in
# vllm-project/aibrix observability/grafana/AIBrix_ModelClaim_Runtime_Dashboard.json (main,
# 2026), less their "or on() vector(0)" fallbacks. The controller's (aibrix_) panels are the
# reconciler's business.
SEL = 'namespace=~"$namespace", pool=~"$pool", pod=~"$pod"'
MSEL = SEL + ', model=~"$model"'
AIBRIX_RUNTIME_PANELS = {
    "Resident Models per Runtime Pod": f"aibrix:modelclaim_models_resident{{{SEL}}}",
    "KV Used": f"aibrix:modelclaim_kv_used_bytes{{{MSEL}}}",
    "KV Capacity (Total)": f"aibrix:modelclaim_kv_total_bytes{{{MSEL}}}",
    "KV Utilization": f"aibrix:modelclaim_kv_used_bytes{{{MSEL}}} / clamp_min("
                      f"aibrix:modelclaim_kv_total_bytes{{{MSEL}}}, 1)",
    "HBM Peak by Model": f"aibrix:modelclaim_hbm_peak_bytes{{{MSEL}}}",
    "Engine State by Runtime Pod": f"sum by (pod, phase) (aibrix:modelclaim_engine_state{{{SEL}}})",
    "Restart Activity / s (attempts)": "sum by (model, pod) (rate("
        f"aibrix:modelclaim_engine_restart_attempts_total{{{MSEL}}}[5m]))",
    "Restart Activity / s (budget)": "sum by (model, pod) (rate("
        f"aibrix:modelclaim_engine_restart_budget_exhausted_total{{{MSEL}}}[5m]))",
    "Re-adoption Outcomes / s": "sum by (pod, result) (rate("
        f"aibrix:modelclaim_engine_re_adoptions_total{{{SEL}}}[5m]))",
    "Sleep / Wake Outcomes / s": "sum by (model, pod, action, result) (rate("
        f"aibrix:modelclaim_lifecycle_operations_total{{{MSEL}}}[5m]))",
    "Sleep / Wake Average Duration": "sum by (model, pod, action, result) (rate("
        f"aibrix:modelclaim_lifecycle_operation_duration_seconds_sum{{{MSEL}}}[5m])) / clamp_min("
        "sum by (model, pod, action, result) (rate("
        f"aibrix:modelclaim_lifecycle_operation_duration_seconds_count{{{MSEL}}}[5m])), 1e-9)",
    "KV Limit Outcomes / s": "sum by (model, pod, result) (rate("
        f"aibrix:modelclaim_kv_limit_operations_total{{{MSEL}}}[5m]))",
    "KV Limit Requested": f"aibrix:modelclaim_kv_limit_requested_bytes{{{MSEL}}}",
    "KV Limit Applied": f"aibrix:modelclaim_kv_limit_applied_bytes{{{MSEL}}}",
}
# What the dashboard's ServiceMonitor adds to every series of the agent's Pod.
SCRAPE_LABELS = {"namespace": "aibrix-system", "pool": "warm-pool", "pod": "runtime-0"}


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def scrapes(port: int) -> int:
    """Successful scrapes of the agent Prometheus holds from the last minute."""
    found = query(port, 'sum_over_time(up{job="runtime"}[1m])')
    return int(float(found[0]["value"][1])) if found else 0


@pytest.fixture
def prometheus(tmp_path: Path, agent: AgentProcess):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: install Debian's prometheus package"
    port = free_port()
    target = agent.url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "runtime", "static_configs": [
            {"targets": [target], "labels": SCRAPE_LABELS}]}]}))
    proc = subprocess.Popen([binary, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_aibrixs_runtime_dashboard_finds_data_for_a_picked_model(
    agent: AgentProcess, prometheus: int,
) -> None:
    agent.activate_sim("awake")
    agent.activate_sim("dozy")
    agent.wait_phase("awake", "active")
    agent.wait_phase("dozy", "active")
    agent.client.kv_limit("dozy", 1 << 30)
    agent.client.sleep("dozy", 1)
    agent.client.wake("dozy")
    agent.client.sleep("dozy", 1)  # one model asleep, as in the issue
    values = {**{f"${k}": v for k, v in SCRAPE_LABELS.items()}, "$model": "dozy"}

    def filled(expr: str) -> str:
        for var, value in values.items():
            expr = expr.replace(var, value)
        return expr

    # rate() needs two samples in its window: wait for three scrapes after the last call.
    first = scrapes(prometheus)
    assert wait_until(lambda: scrapes(prometheus) >= first + 3, timeout=30, interval=0.25)
    empty = {title: filled(expr) for title, expr in AIBRIX_RUNTIME_PANELS.items()
             if not query(prometheus, filled(expr))}
    assert empty == {}
    # With the model picked, the duration panel shows that model's sleeps and wakes.
    duration = query(prometheus, filled(AIBRIX_RUNTIME_PANELS["Sleep / Wake Average Duration"]))
    assert {(r["metric"]["model"], r["metric"]["action"], r["metric"]["result"])
            for r in duration} == {("dozy", "sleep", "success"), ("dozy", "wake", "success")}
    assert {r["metric"]["pod"] for r in duration} == {"runtime-0"}
