"""The claim reconciler's parts: snapshot cache, routes and wake requests, status store,
manifest directory, events mapping, HTTP API, metrics, CLI output and layering."""

from __future__ import annotations

import ast
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from contract.quantity import GiB
from reconciler.cli import describe, table
from reconciler.local.desired import DesiredState
from reconciler.metrics import ClaimMetrics
from reconciler.model.manifests import AgentRef
from reconciler.observe import SnapshotCache
from reconciler.routes import RouteHolds, WakeBook, route_table
from reconciler.server import make_app, serve
from reconciler.status import ClaimStatus
from reconciler.store import StatusStore
from tests.clocks import FakeClock
from tests.reconciler_fakes import FakeAgent, Rig, claim_yaml

pytestmark = [pytest.mark.timeout(30), pytest.mark.loop_guard]
ROOT = Path(__file__).resolve().parent.parent


# ---- snapshot cache ---------------------------------------------------------------------------


async def test_concurrent_reconciles_share_one_snapshot_fetch_within_its_ttl() -> None:
    clock, agent = FakeClock(), FakeAgent("a")
    gate = asyncio.Event()
    real = agent.snapshot

    async def slow() -> dict[str, Any]:
        await gate.wait()
        return await real()

    agent.snapshot = slow  # type: ignore[method-assign]
    cache = SnapshotCache({"a": agent}.get, clock, ttl=0.1)
    readers = [asyncio.ensure_future(cache.get("a")) for _ in range(5)]
    await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(*readers)
    assert agent.snapshots == 1 and all(r is results[0] for r in results)
    await cache.get("a")
    assert agent.snapshots == 1
    clock.advance(0.2)
    await cache.get("a")
    assert agent.snapshots == 2
    await cache.fresh("a")
    assert agent.snapshots == 3


async def test_a_silent_agent_keeps_its_last_snapshot_marked_unhealthy() -> None:
    clock, agent = FakeClock(), FakeAgent("a")
    agent.add("m")
    cache = SnapshotCache({"a": agent}.get, clock)
    assert (await cache.get("a")).ok
    agent.reachable = False
    clock.advance(5)
    obs = await cache.get("a")
    assert not obs.ok and obs.engine("m") is not None and obs.seen_at == 0.0


# ---- routes -----------------------------------------------------------------------------------


def status(name: str, phase: str, ready: str = "", sched: str = "") -> ClaimStatus:
    st = ClaimStatus("default", name, "uid", 0.0, model_name=f"m-{name}")
    st.set(1.0, phase, scheduled=(sched == "Placed", sched or "Placed", ""),
           ready=(phase == "Active", ready or "ModelClaimActive", ""))
    st.set_instance("agent-a", 20001, (0,))
    return st


def test_the_route_has_a_port_only_while_active_healthy_and_not_held() -> None:
    holds, wakes = RouteHolds(), WakeBook()
    statuses = [status("a", "Active"), status("b", "Sleeping", "WaitingForRoom"),
                status("c", "Pending", "NotPlaced", "NoMatchingPods"),
                status("d", "Failed", "Moving"), status("e", "Activating", "EngineStarting")]
    urls = {"agent-a": "http://10.0.0.5:8080"}
    routes = {r.claim: r for r in route_table(statuses, urls, lambda a: True, holds, wakes)}
    assert (routes["default/a"].state, routes["default/a"].port,
            routes["default/a"].host) == ("active", 20001, "10.0.0.5")
    assert (routes["default/b"].state, routes["default/b"].reason) == ("sleeping",
                                                                       "WaitingForRoom")
    assert (routes["default/c"].state, routes["default/c"].reason) == ("activating",
                                                                       "NoMatchingPods")
    assert (routes["default/d"].state, routes["default/d"].reason) == ("failed", "Moving")
    assert all(r.port == 0 for k, r in routes.items() if k != "default/a")
    holds.hold("m-a")
    (held,) = [r for r in route_table(statuses, urls, lambda a: True, holds, wakes)
               if r.claim == "default/a"]
    assert (held.state, held.port) == ("sleeping", 0)
    (down,) = [r for r in route_table(statuses, urls, lambda a: False, RouteHolds(), wakes)
               if r.claim == "default/a"]
    assert down.port == 0


def test_wake_requests_collapse_and_expire_after_five_minutes() -> None:
    wakes = WakeBook()
    first, new = wakes.request("m", ("default", "c"), 0.0, 0.0)
    second, again = wakes.request("m", ("default", "c"), 10.0, 0.0)
    assert new and not again and first is second and first.repeats == 1
    assert not wakes.expired(first, 299.0) and wakes.expired(first, 300.0)
    third, renewed = wakes.request("m", ("default", "c"), 300.0, 0.0)
    assert renewed and third is not first


# ---- status store -----------------------------------------------------------------------------


async def test_statuses_are_written_atomically_and_read_back(tmp_path: Path) -> None:
    store = StatusStore(tmp_path / ".status", lambda: 1.8e9)
    rig_claim = Rig(tmp_path, [FakeAgent("x")], claim_yaml("c")).desired.claim(("default", "c"))
    assert rig_claim is not None
    st = store.ensure(rig_claim)
    st.set(1.8e9, "Active", scheduled=(True, "Placed", "on x"), ready=(True, "ModelClaimActive",
                                                                        "serves"))
    st.set_instance("x", 20000, (0,))
    st.event(1.8e9, "Activated", "serves on x")
    st.event(1.8e9, "Activated", "serves on x")
    await store.flush()
    files = sorted(p.name for p in (tmp_path / ".status").iterdir())
    assert files == ["default_c.json"]
    again = StatusStore(tmp_path / ".status", lambda: 1.8e9)
    again.load()
    loaded = again.get(("default", "c"))
    assert loaded is not None and loaded.as_json() == st.as_json()
    assert loaded.events[-1].count == 2
    again.drop(("default", "c"))
    await again.flush()
    assert list((tmp_path / ".status").iterdir()) == []


def test_events_are_bounded() -> None:
    st = ClaimStatus("default", "c", "u", 0.0)
    for i in range(80):
        st.event(float(i), "KVLimitSet", f"limit {i}")
    assert len(st.events) == 50 and st.events[-1].message == "limit 79"


# ---- manifests --------------------------------------------------------------------------------


def test_a_broken_change_keeps_the_last_valid_claim_and_reports_it(tmp_path: Path) -> None:
    rig = Rig(tmp_path, [FakeAgent("a")], claim_yaml("c"))
    before = rig.desired.claim(("default", "c"))
    broken = claim_yaml("c").replace("replicas", "x").replace("engine: vllm", "replicas: 9")
    rig.write_claims(broken)
    assert rig.desired.claim(("default", "c")) == before
    assert any(p.reason == "InvalidReplicas" for p in rig.desired.problems)


def test_a_changed_pool_enqueues_every_claim(tmp_path: Path) -> None:
    rig = Rig(tmp_path, [FakeAgent("a")], claim_yaml("c") + claim_yaml("d"))
    path = tmp_path / "pool.yaml"
    old = path.read_text()
    new = old.replace("spec:", 'spec:\n  policy: {"lifecycle": {"sleepAfterSeconds": 5}}')
    assert list(rig.desired.on_file(path, old, new)) == [("default", "c"), ("default", "d")]
    assert list(rig.desired.on_file(tmp_path / "claims.yaml", None,
                                    claim_yaml("c") + claim_yaml("d"))) == []


def test_embedded_mode_makes_the_local_agent_the_pool_selected_by_the_claims(
        tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(claim_yaml("c", pool="pool-b"))
    desired = DesiredState(tmp_path, local_agent=AgentRef("node-1", "http://127.0.0.1:8080"))
    desired.load()
    ((agent, pool),) = desired.agents()
    assert agent.name == "node-1" and agent.labels["claim.model.aibrix.ai/pool"] == "pool-b"
    assert agent.labels["claim.model.aibrix.ai/enabled"] == "true"


def test_an_invalid_pool_policy_is_reported_and_turned_off(tmp_path: Path) -> None:
    rig = Rig(tmp_path, [FakeAgent("a")], claim_yaml("c"),
              policy='{"lifecycle": {"sleepAfterSeconds": -1}}')
    (pool,) = rig.desired.pools
    assert not pool.policy_valid and not pool.policy.idle_sleep
    assert [p.reason for p in rig.desired.problems] == ["InvalidPoolPolicy"]


# ---- events -----------------------------------------------------------------------------------


async def test_an_engine_event_enqueues_its_claim_and_room_enqueues_the_waiting(
        tmp_path: Path) -> None:
    a = FakeAgent("a", card=8 * GiB)
    rig = Rig(tmp_path, [a], claim_yaml("m", footprint="4Gi") + claim_yaml("w", footprint="4Gi"))
    await rig.reconcile("m")
    await rig.reconcile("w")
    assert rig.status("w").phase == "Pending"
    keys = rig.deps.event_keys("a", {"model": "m", "from": "active", "to": "sleeping",
                                     "reason": "Slept"})
    assert keys == [("default", "m"), ("default", "w")] and rig.kv_kicks[-1] == "a"
    assert rig.deps.event_keys("a", {"model": "m", "from": "active", "to": "active",
                                     "reason": "KVLimitSet"}) == []


# ---- HTTP API and metrics ---------------------------------------------------------------------


async def test_the_api_serves_claims_routes_wake_requests_and_metrics(tmp_path: Path) -> None:
    a = FakeAgent("a")
    rig = Rig(tmp_path, [a], claim_yaml("m", "model-m"))
    registry = CollectorRegistry()
    ClaimMetrics(registry, rig.store, rig.desired, rig.deps.reader.wall)
    await rig.reconcile("m")
    await a.sleep("model-m")
    await rig.reconcile("m")
    runner, port = await serve(make_app(rig.deps, registry), "127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/v1/claims") as resp:
                items = (await resp.json())["items"]
            assert [i["status"]["phase"] for i in items] == ["Sleeping"]
            async with http.get(f"{base}/v1/claims/default/m") as resp:
                assert (await resp.json())["route"]["state"] == "sleeping"
            async with http.get(f"{base}/v1/claims/default/nope") as resp:
                assert resp.status == 404
            for expected_new in (True, False):
                async with http.post(f"{base}/v1/routes/model-m/wake") as resp:
                    body = await resp.json()
                    assert resp.status == 202 and body["new"] is expected_new
            assert rig.claim_kicks == [("default", "m")]
            async with http.post(f"{base}/v1/routes/unknown/wake") as resp:
                assert resp.status == 404
            async with http.get(f"{base}/v1/routes") as resp:
                (route,) = (await resp.json())["routes"]
            assert route["wakeRequested"] and route["state"] == "sleeping"
            async with http.get(f"{base}/metrics") as resp:
                text = await resp.text()
    finally:
        await runner.cleanup()
    for name in ("aibrix_modelclaim_desired_replicas", "aibrix_modelclaim_ready_replicas",
                 "aibrix_modelclaim_activating", "aibrix_modelclaim_activation_total",
                 "aibrix_modelclaim_no_ready_duration_seconds",
                 "aibrix_modelclaim_pool_policy_valid",
                 "aibrix_modelclaim_pool_policy_evaluations_total",
                 "aibrix_modelclaim_pool_policy_actions_total"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert 'aibrix_modelclaim_desired_replicas{name="m",namespace="default"} 1.0' in text


# ---- CLI --------------------------------------------------------------------------------------


def test_claims_get_prints_the_guides_table_and_describe_the_conditions_and_events() -> None:
    st = ClaimStatus("default", "qwen3-0-6b", "u", 1000.0, "qwen3-0.6b", "vllm",
                     "huggingface://Qwen/Qwen3-0.6B")
    st.set(1000.0, "Active", scheduled=(True, "Placed", "placed on a (GPU 0)"),
           ready=(True, "ModelClaimActive", "serves on a port 20000"))
    st.event(1000.0, "Activated", "serves on a port 20000")
    doc = json.loads(json.dumps(st.as_json()))
    lines = table([doc], now=1180.0).splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "DESIRED", "READY", "ENGINE", "ARTIFACT", "AGE"]
    assert lines[1].split() == ["qwen3-0-6b", "Active", "1", "1", "vllm",
                                "huggingface://Qwen/Qwen3-0.6B", "3m"]
    rows = [line.split()[:4] for line in describe(doc, now=1180.0).splitlines()]
    assert ["Scheduled", "True", "Placed", "3m"] in rows
    assert ["Ready", "True", "ModelClaimActive", "3m"] in rows
    assert ["Normal", "Activated", "3m", "serves"] in rows


def test_describe_shows_sizes_as_a_manifest_writes_them() -> None:
    st = ClaimStatus("default", "m", "u", 1000.0, "m", "vllm", "huggingface://a/b")
    doc = json.loads(json.dumps(st.as_json()))
    doc["spec"]["perGPU"] = {"maximumFootprint": 6 * 2**30, "kvFloor": 1536 * 2**20 + 1}
    per_gpu = next(line for line in describe(doc, now=1000.0).splitlines()
                   if line.startswith("Per GPU:"))
    assert per_gpu.split(None, 2)[2] == "maximumFootprint 6Gi, kvFloor 1610612737"


# ---- layering ---------------------------------------------------------------------------------


def test_the_reconciler_talks_to_agents_only_through_its_client() -> None:
    offenders = []
    for path in (ROOT / "reconciler").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] in ("runtime_agent", "engines", "registry") for n in names):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


async def test_the_embedded_reconciler_reconciles_its_agents_claims_until_stopped(
        tmp_path: Path) -> None:
    from reconciler.local.embedded import embedded_reconciler

    status = tmp_path / ".status" / "default_c.json"
    (tmp_path / "c.yaml").write_text(claim_yaml("c"))
    companion = embedded_reconciler("0.0.0.0", 1, str(tmp_path), "127.0.0.1", 0)
    await companion.start()
    try:
        for _ in range(200):  # until the claim was reconciled (its status written)
            if status.exists():
                break
            await asyncio.sleep(0.05)
    finally:
        await companion.stop()
    doc = json.loads(status.read_text())
    assert doc["status"]["phase"] == "Pending"  # its agent (port 1) does not answer


async def test_a_status_directory_that_cannot_be_written_is_one_line_an_outage(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Descriptors run out (EMFILE) or a disk fills: the flusher retried every second with a
    full traceback each time; now the outage is one line, and its end another."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the status directory's parent should be")
    store = StatusStore(blocker / ".status", lambda: 1.8e9)
    tries = 0
    tried = asyncio.Event()
    flush = store.flush

    async def counted() -> None:
        nonlocal tries
        tries += 1
        if tries >= 3:
            tried.set()
        await flush()

    store.flush = counted  # type: ignore[method-assign]
    claim = Rig(tmp_path, [FakeAgent("x")], claim_yaml("c")).desired.claim(("default", "c"))
    assert claim is not None
    caplog.set_level(logging.INFO, logger="reconciler.store")
    store.start()
    store.ensure(claim)
    await asyncio.wait_for(tried.wait(), 10)  # three failed writes
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is None
    blocker.unlink()
    blocker.mkdir()
    written = blocker / ".status" / "default_c.json"
    for _ in range(100):  # the flusher's next retry, within its second
        if written.exists():
            break
        await asyncio.sleep(0.05)
    await store.stop()
    assert written.exists()
    assert any("again" in r.getMessage() for r in caplog.records)
