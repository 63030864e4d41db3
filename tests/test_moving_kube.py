"""Make before break on Kubernetes (issue 25, items 3 and 4): the API server stand-in
(``tests.kube_api`` through kmock), the reconciler and its door in this process, two pool Pods
backed by real agents with simulated engines. Labelling a Pod ``claim.model.aibrix.ai/draining:
"true"`` moves its claim to the other Pod under steady load through the door: no request
fails, and the claim's route annotation moves with it."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from reconciler.door.settings import DoorSettings
from reconciler.kube.api import PODS
from tests.harness import AgentProcess
from tests.test_reconciler_kube import Cluster, claim_obj, running_cluster
from tests.test_reconciler_kube_door import chat, pod_agent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path) as made:
        yield made


async def test_a_draining_pod_s_claim_moves_to_the_other_pod_without_a_failed_request(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    await cluster.add_pod("pool-0", pod_agent(agent_factory))
    await cluster.add_pod("pool-1", pod_agent(agent_factory))
    app = await cluster.start(door=DoorSettings(port=0))
    await cluster.apply(claim_obj("m", {"--sim-request-seconds": "0.1",
                                        "--sim-startup-seconds": "1.5"}, "2Gi"))
    await cluster.until("m Active", lambda: cluster.phase("m") == "Active", 60)
    assert app.door is not None and app.door.port > 0  # listening since it led
    port = app.door.port
    old = ((cluster.claim("m") or {}).get("status") or {})["instances"][0]["pod"]
    new = "pool-1" if old == "pool-0" else "pool-0"
    stop = asyncio.Event()
    statuses: list[int] = []

    async def steady() -> None:
        while not stop.is_set():
            statuses.append((await chat(port, "m-model"))[0])

    callers = [asyncio.ensure_future(steady()) for _ in range(3)]
    await cluster.until("calls answered", lambda: len(statuses) >= 10)
    await cluster.api.patch(PODS, "default", old, {"metadata": {"labels": {
        "claim.model.aibrix.ai/draining": "true"}}})

    def moved() -> bool:
        st = (cluster.claim("m") or {}).get("status") or {}
        pods = [i["pod"] for i in st.get("instances") or ()]
        return pods == [new] and [n for n, _ in cluster.engines("m-model")] == [new]

    await cluster.until("the claim moved and the old engine stopped", moved, 60)
    await cluster.until("its route on the new Pod", lambda: (
        cluster.route(new, "m") or {}).get("state") == "active")
    await cluster.until("no route left on the old Pod", lambda: cluster.route(old, "m") is None)
    count = len(statuses)
    await cluster.until("calls answered after the move", lambda: len(statuses) >= count + 5)
    stop.set()
    await asyncio.gather(*callers)
    assert set(statuses) == {200}, [s for s in statuses if s != 200]
    reasons = [e.get("reason") for e in cluster.server.all_of("events")
               if e["involvedObject"]["name"] == "m"]
    assert "Moving" in reasons and "Moved" in reasons


async def test_a_pod_being_deleted_drains_its_claim_to_the_other_pod_before_it_goes(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    """A rollout or a node drain deletes the Pod: during its grace period (a finalizer holds
    it here, as the kubelet's preStop does in a cluster) it reads as draining, its claim moves
    make before break, and its agent's ``wait-drained`` (the Pod's preStop) returns once no
    engine runs there."""
    await cluster.add_pod("pool-0", pod_agent(agent_factory))
    await cluster.start()
    await cluster.apply(claim_obj("m", footprint="2Gi"))
    await cluster.until("m Active", lambda: cluster.phase("m") == "Active", 60)
    await cluster.add_pod("pool-1", pod_agent(agent_factory))  # the rollout's new Pod
    await cluster.api.patch(PODS, "default", "pool-0", {"metadata": {
        "finalizers": ["test/held"]}})
    await cluster.api.delete(PODS, "default", "pool-0")
    assert (cluster.pod("pool-0") or {}).get("metadata", {}).get("deletionTimestamp")
    waiter = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "runtime_agent.cli", "wait-drained", "--timeout", "60",
        "--url", cluster.agents["pool-0"].url, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    await cluster.until("the claim on pool-1", lambda: [
        i["pod"] for i in ((cluster.claim("m") or {}).get("status") or {}).get("instances")
        or ()] == ["pool-1"], 60)
    out, _ = await asyncio.wait_for(waiter.communicate(), 60)
    assert waiter.returncode == 0, out
    assert b"1 engine(s) still run here: m-model" in out and b"no engine runs here" in out
    assert [n for n, _ in cluster.engines("m-model")] == ["pool-1"]
    reasons = [e.get("reason") for e in cluster.server.all_of("events")
               if e["involvedObject"]["name"] == "m"]
    assert "Moved" in reasons
