"""Replicas on Kubernetes (issue 25): the API server stand-in (``tests.kube_api`` through
kmock), the reconciler in this process, two pool Pods backed by real agents with simulated
engines. A claim with ``replicas: 2`` has an engine on each Pod, the seed's per-claim route
annotation on each Pod (so the AIBrix gateway finds both copies by the key it knows), one entry
per replica in ``status.instances``, Events on the claim itself; scaling down removes one
copy and its annotation, and a deletion waits behind the finalizer for every copy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from reconciler.door.settings import DoorSettings
from reconciler.kube.api import CLAIMS, DEPLOYMENTS, MERGE_PATCH, PODS
from tests.harness import AgentProcess
from tests.test_reconciler_kube import Cluster, agent_for, claim_obj, running_cluster
from tests.test_reconciler_kube_door import chat, pod_agent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path) as made:
        yield made


def replicated(name: str, replicas: int) -> dict[str, Any]:
    obj = claim_obj(name)
    obj["spec"]["replicas"] = replicas
    return obj


def status(cluster: Cluster, name: str) -> dict[str, Any]:
    return (cluster.claim(name) or {}).get("status") or {}


async def two_pods(cluster: Cluster, factory: Callable[..., AgentProcess]) -> None:
    await cluster.add_pod("pool-0", agent_for(factory))
    await cluster.add_pod("pool-1", agent_for(factory))


async def two_ready(cluster: Cluster, factory: Callable[..., AgentProcess]) -> None:
    """Two pool Pods and claim ``m`` with two replicas, both ready."""
    await two_pods(cluster, factory)
    await cluster.start()
    await cluster.apply(replicated("m", 2))
    await cluster.until("both replicas ready", lambda: status(cluster, "m").get(
        "readyReplicas") == 2, 60)


async def test_two_replicas_run_on_two_pods_each_with_the_claims_route_annotation(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    await two_ready(cluster, agent_factory)
    st = status(cluster, "m")
    assert st["phase"] == "Active" and st["desiredReplicas"] == 2
    instances = sorted(st["instances"], key=lambda i: i["index"])
    assert [i["index"] for i in instances] == [0, 1]
    assert sorted(i["pod"] for i in instances) == ["pool-0", "pool-1"]
    for inst in instances:
        pod: str = inst["pod"]

        def active(pod: str = pod) -> bool:
            route = cluster.route(pod, "m")
            return route is not None and route["state"] == "active"

        await cluster.until(f"the route on {pod}", active)
        route = cluster.route(pod, "m")
        assert route is not None
        assert (route["model"], route["port"]) == ("m-model", inst["port"])
    assert sorted(name for name, _ in cluster.engines("m-model")) == ["pool-0", "pool-1"]
    for pod in ("pool-0", "pool-1"):  # no annotation a gateway would not know
        annotations = (cluster.pod(pod) or {})["metadata"].get("annotations") or {}
        assert [k for k in annotations if "#" in k] == []
    involved = {e["involvedObject"]["name"] for e in cluster.server.all_of("events")}
    assert "m" in involved and not any("#" in name for name in involved)


async def test_scaling_down_removes_a_copy_and_its_annotation_and_deleting_waits_for_all(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    await two_ready(cluster, agent_factory)
    gone = next(i["pod"] for i in status(cluster, "m")["instances"] if i["index"] == 1)
    await cluster.api.patch(CLAIMS, "default", "m", {"spec": {"replicas": 1}}, MERGE_PATCH)
    await cluster.until("one replica left", lambda: len(status(cluster, "m").get(
        "instances") or ()) == 1 and status(cluster, "m").get("desiredReplicas") == 1)
    await cluster.until("its engine stopped", lambda: gone not in
                        [name for name, _ in cluster.engines("m-model")])
    await cluster.until("its annotation removed", lambda: cluster.route(gone, "m") is None)
    kept = status(cluster, "m")["instances"][0]["pod"]
    assert kept != gone and cluster.route(kept, "m") is not None
    assert status(cluster, "m")["readyReplicas"] == 1
    await cluster.api.patch(CLAIMS, "default", "m", {"spec": {"replicas": 2}}, MERGE_PATCH)
    await cluster.until("two again", lambda: status(cluster, "m").get("readyReplicas") == 2, 60)
    await cluster.api.delete(CLAIMS, "default", "m")
    await cluster.until("the claim gone", lambda: cluster.claim("m") is None, 60)
    assert cluster.engines("m-model") == [], "every copy stopped before the object went"
    assert cluster.route("pool-0", "m") is None and cluster.route("pool-1", "m") is None


async def test_the_gateways_wake_annotation_wakes_a_sleeping_replica_when_replica_0_cannot(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    """The wake annotation once asked replica 0 only: with replica 0 gone (its Pod deleted,
    no other Pod for it) and replica 1 asleep, the gateway's wake woke nothing."""
    await cluster.api.patch(DEPLOYMENTS, "default", "warm-runtime-pool", {"metadata": {
        "annotations": {"claim.model.aibrix.ai/pool-policy":
                        '{"lifecycle":{"sleepAfterSeconds":1}}'}}})
    await two_pods(cluster, agent_factory)
    await cluster.start()
    await cluster.apply(replicated("m", 2))
    await cluster.until("both replicas asleep", lambda: [
        i["phase"] for i in status(cluster, "m").get("instances") or ()] == ["Sleeping"] * 2, 60)
    zero = next(i["pod"] for i in status(cluster, "m")["instances"] if i["index"] == 0)
    kept = "pool-1" if zero == "pool-0" else "pool-0"
    await cluster.api.delete(PODS, "default", zero)
    cluster.agents[zero].cleanup()  # the Pod's containers go with it
    await cluster.until("replica 0 has nowhere to go", lambda: [
        (i["index"], i["phase"]) for i in status(cluster, "m").get("instances") or ()]
        == [(1, "Sleeping")], 60)
    key = "wake.modelclaim.aibrix.ai/m"
    await cluster.api.patch(PODS, "default", kept, {"metadata": {"annotations": {
        key: "2026-01-01T00:00:00Z"}}})
    await cluster.until("replica 1 woken", lambda: "Woken" in [
        e["reason"] for e in cluster.server.all_of("events")
        if e["involvedObject"]["name"] == "m"])
    await cluster.until("the wake request removed", lambda: key not in (
        cluster.pod(kept) or {})["metadata"].get("annotations", {}))


async def test_a_sustained_burst_through_the_door_adds_a_copy_on_the_other_pod_and_idle_removes_it(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    """Copies by demand with the CRD's ``maxReplicas``: one call at a time per engine, 1 s
    each, four callers in a loop through the door: a second copy starts on the other Pod with
    the claim's route annotation there; idle, it sleeps after 1 s and is removed after 2 s."""
    await cluster.api.patch(DEPLOYMENTS, "default", "warm-runtime-pool", {"metadata": {
        "annotations": {"claim.model.aibrix.ai/pool-policy":
                        '{"lifecycle":{"sleepAfterSeconds":1}}'}}})
    await cluster.add_pod("pool-0", pod_agent(agent_factory))
    await cluster.add_pod("pool-1", pod_agent(agent_factory))
    app = await cluster.start(door=DoorSettings(port=0))
    assert app.door is not None
    obj = claim_obj("m", {"--max-num-seqs": "1", "--sim-request-seconds": "1"}, "2Gi")
    obj["spec"]["maxReplicas"] = 2
    await cluster.apply(obj)
    await cluster.until("one copy ready", lambda: status(cluster, "m").get("readyReplicas") == 1,
                        60)
    answered: list[int] = []

    async def caller(port: int) -> None:
        while status(cluster, "m").get("readyReplicas") != 2 and len(answered) < 200:
            answered.append((await chat(port, "m-model"))[0])

    await asyncio.gather(*(caller(app.door.port) for _ in range(4)))
    assert set(answered) == {200}
    st = status(cluster, "m")
    assert st["desiredReplicas"] == 2
    assert sorted(i["pod"] for i in st["instances"]) == ["pool-0", "pool-1"]
    await cluster.until("the route on pool-1", lambda: (cluster.route("pool-1", "m") or {})
                        .get("state") == "active")
    reasons = {e.get("reason") for e in cluster.server.all_of("events")
               if e["involvedObject"]["name"] == "m"}
    assert "ScaledUp" in reasons
    await cluster.until("the copy removed", lambda: status(cluster, "m").get(
        "desiredReplicas") == 1 and len(status(cluster, "m").get("instances") or []) == 1, 60)
    await cluster.until("its annotation gone", lambda: cluster.route("pool-1", "m") is None)
    assert [name for name, _ in cluster.engines("m-model")] == ["pool-0"]
