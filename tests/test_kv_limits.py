"""KV-cache limits through kvcached segments: set, confirm, hold, restore, clean up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from runtime_agent.client import AgentError
from runtime_agent.kv.segment import create_segment, read_segment, write_limit
from tests.harness import AgentProcess

pytestmark = pytest.mark.integration
GiB, MiB = 2**30, 2**20


def kv_events(agent: AgentProcess, model: str) -> list[dict]:
    return [e for e in agent.client.events(0)["events"]
            if e["model"] == model and e["reason"].startswith("KVLimit")]


def test_an_initial_limit_is_in_force_as_soon_as_the_segment_exists(agent: AgentProcess) -> None:
    """The agent writes the limit the moment the engine creates its segment (the goal, 200 ms,
    is measured by ``python -m bench.bench_kv``; here a loaded CI machine gets 1 s)."""
    seen: dict[str, float] = {}
    path = agent.shm_dir / "kvc_m1"

    def watch() -> None:  # the test's own 1 ms look for the segment
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not path.exists():
            time.sleep(0.001)
        seen["at"] = time.time()

    watcher = threading.Thread(target=watch)
    watcher.start()
    agent.activate_sim("m1", "--sim-startup-seconds=0.3", kv_limit_bytes=GiB)
    watcher.join()
    model = agent.wait_for(lambda s: agent.model(s, "m1")["kv_limit_applied_bytes"] == GiB,
                           what="limit applied")
    event = kv_events(agent, "m1")[0]
    assert event["reason"] == "KVLimitSet"
    assert event["ts"] - seen["at"] < 1.0
    info = read_segment("kvc_m1", agent.shm_dir)
    assert info is not None and info.total_size == GiB
    m1 = agent.model(model, "m1")
    assert m1["kv_startup_capacity_bytes"] == 2 * GiB  # what the engine started with
    assert m1["kv_capacity_bytes"] == GiB  # what it obeys now, as AIBrix reads the field
    assert m1["kv_segment"] == {"name": "kvc_m1", "present": True}


def test_a_limit_change_is_confirmed_by_read_back_and_repeats_by_id(agent: AgentProcess) -> None:
    agent.activate_sim("m1")
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_segment"]["present"], what="segment")
    result = agent.client.kv_limit("m1", 512 * MiB, operation_id="kv-1")
    assert result["status"] == "success" and result["applied"] is True
    assert result["requested_bytes"] == result["applied_bytes"] == 512 * MiB
    assert result["clamped"] is False
    assert read_segment("kvc_m1", agent.shm_dir).total_size == 512 * MiB
    assert agent.client.kv_limit("m1", 512 * MiB, operation_id="kv-1") == {**result, "applied": False}
    clamped = agent.client.kv_limit("m1", 64 * GiB)
    assert clamped["clamped"] is True and clamped["applied_bytes"] == 2 * GiB
    assert "clamped" in clamped["message"]
    with pytest.raises(AgentError) as err:
        agent.client.kv_limit("m1", -1)
    assert err.value.status == 422 and "limit_bytes" in str(err.value)
    lifted = agent.client.kv_limit("m1", 0)  # kvcached reads 0 as "no limit"
    assert lifted["in_force"] is True and lifted["applied_bytes"] == 2 * GiB
    assert read_segment("kvc_m1", agent.shm_dir).total_size == 2 * GiB
    with pytest.raises(AgentError) as err:
        agent.client.kv_limit("nope", GiB)
    assert err.value.status == 404


def test_a_limit_asked_before_the_segment_exists_waits_for_it(agent: AgentProcess) -> None:
    agent.activate_sim("m1", "--sim-startup-seconds=1.0")
    result = agent.client.kv_limit("m1", GiB)
    assert result["in_force"] is False and "not created its KV segment" in result["message"]
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_limit_applied_bytes"] == GiB,
                   what="limit applied once the segment appears")


def test_an_outside_write_is_set_back_and_counted(agent: AgentProcess) -> None:
    agent.activate_sim("m1", kv_limit_bytes=GiB)
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_limit_applied_bytes"] == GiB, what="set")
    write_limit("kvc_m1", 3 * GiB // 2, agent.shm_dir)  # someone else, e.g. kvctl
    snap = agent.wait_for(lambda s: agent.model(s, "m1")["kv_limit_set_back_total"] == 1,
                          what="set back")
    assert read_segment("kvc_m1", agent.shm_dir).total_size == GiB
    m1 = agent.model(snap, "m1")
    assert m1["kv_limit_applied_bytes"] == GiB and m1["conditions"] == []
    assert [e["reason"] for e in kv_events(agent, "m1")] == ["KVLimitSet", "KVLimitSetBack"]


def test_an_engine_restart_gets_its_limit_back(agent: AgentProcess) -> None:
    first = agent.activate_sim("m1", kv_limit_bytes=GiB)
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_limit_applied_bytes"] == GiB, what="set")
    os.kill(first["pid"], signal.SIGKILL)
    agent.wait_for(lambda s: agent.model(s, "m1")["restart_count"] == 1
                   and agent.model(s, "m1")["pid"] not in (None, first["pid"])
                   and agent.model(s, "m1")["kv_limit_applied_bytes"] == GiB, what="restored")
    # tmpfs may give the new segment the old inode number: the owner knows of the restart.
    assert read_segment("kvc_m1", agent.shm_dir).total_size == GiB
    assert kv_events(agent, "m1")[-1]["reason"] == "KVLimitRestored"


def _post_completion(port: int) -> None:
    body = json.dumps({"model": "m1", "prompt": "x", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()


def test_a_limit_below_use_is_reported_honestly_until_load_drains(agent: AgentProcess) -> None:
    port = agent.activate_sim("m1", "--sim-request-seconds=3")["port"]
    agent.wait_phase("m1", "active")
    clients = [threading.Thread(target=_post_completion, args=(port,)) for _ in range(4)]
    for c in clients:
        c.start()
    agent.wait_for(lambda s: (agent.model(s, "m1")["kv_used_bytes"] or 0) >= 256 * MiB,
                   what="four requests' KV in use", poll_s=0.05)
    result = agent.client.kv_limit("m1", 128 * MiB)
    assert result["applied"] is True and result["used_bytes"] >= 256 * MiB
    assert "above the limit" in result["message"]
    snap = agent.client.snapshot()
    assert agent.model(snap, "m1")["kv_used_bytes"] > agent.model(snap, "m1")[
        "kv_limit_applied_bytes"]
    for c in clients:
        c.join(30)
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_used_bytes"] <= 128 * MiB, what="drained", poll_s=0.1)


def test_segments_of_engines_that_stop_for_good_are_removed_and_others_kept(
    agent_factory,
) -> None:
    agent: AgentProcess = agent_factory(restart_delays="0.05")
    create_segment("someone-else", 4 * GiB, agent.shm_dir)
    agent.activate_sim("doomed", "--sim-crash-after=0.4")
    agent.wait_phase("doomed", "failed", timeout_s=30)
    assert not (agent.shm_dir / "kvc_doomed").exists()
    agent.activate_sim("m1")
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_segment"]["present"], what="segment")
    agent.client.deactivate("m1")
    assert not (agent.shm_dir / "kvc_m1").exists()
    assert read_segment("someone-else", agent.shm_dir).total_size == 4 * GiB


def test_a_restarted_agent_holds_the_limits_it_set(agent_factory) -> None:
    from tests.test_readoption import restart_agent

    agent: AgentProcess = agent_factory()
    agent.activate_sim("m1", kv_limit_bytes=GiB)
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_limit_applied_bytes"] == GiB, what="set")
    agent.kill()
    write_limit("kvc_m1", 2 * GiB, agent.shm_dir)  # changed while no agent watched
    new = restart_agent(agent_factory, agent)
    new.wait_for(lambda s: new.model(s, "m1")["kv_limit_applied_bytes"] == GiB
                 and new.model(s, "m1")["kv_limit_set_back_total"] == 1, what="held again")
    assert read_segment("kvc_m1", agent.shm_dir).total_size == GiB


def test_the_cli_snapshot_shows_the_kv_figures(agent: AgentProcess) -> None:
    agent.activate_sim("m1", kv_limit_bytes=GiB)
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_limit_applied_bytes"] == GiB, what="set")
    out = subprocess.run([sys.executable, "-m", "runtime_agent.cli", "snapshot", "--url",
                          agent.url], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    header, row = out.stdout.splitlines()[:2]
    assert "KV LIMIT" in header and "KV USED" in header

    def cell(name: str) -> str:  # columns are left-aligned under their headers
        start = header.index(name)
        return row[start:].split("  ")[0].strip()

    assert (cell("KV LIMIT"), cell("KV APPLIED")) == ("1.0GiB", "1.0GiB")
