"""ModelRoute on Kubernetes, end to end (issue 24): ModelRoute objects in the API server
stand-in (``tests.kube_api``), the reconciler and its door in this process, real agents with
simulated engines as the pool's Pods, clients over real sockets. A route is taken by the same
rule as in the claims directory (``tests/test_modelroute_manifests.py``), served by the door as
there (``tests/test_door_modelroute.py``), and its candidates and ``FailedScheduling`` are
written to its status, where ``kubectl get modelroutes`` shows them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from reconciler.door.settings import DoorSettings
from reconciler.kube.api import ROUTES
from reconciler.kube.app import KubeApp
from tests.harness import AgentProcess
from tests.test_reconciler_kube import Cluster, claim_obj, running_cluster
from tests.test_reconciler_kube_door import chat, get, pod_agent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]
POD_IP = "127.0.0.2"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path) as made:
        yield made


def labelled(name: str, **labels: str) -> dict[str, Any]:
    """A claim whose ``metadata.labels`` say what its model is."""
    obj = claim_obj(name)
    obj["metadata"]["labels"] = labels
    return obj


def route_obj(name: str, family: str = "qwen", **spec: Any) -> dict[str, Any]:
    """A route over the ``family`` claims that prefers the big tier (60) over the small (55)."""
    return {"apiVersion": "model.aibrix.ai/v1alpha1", "kind": "ModelRoute",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"require": {"matchLabels": {"family": family}},
                     "prefer": [{"weight": 60, "selector": {"matchLabels": {"tier": "big"}}},
                                {"weight": 55, "selector": {"matchLabels": {"tier": "small"}}}],
                     **spec}}


def condition(cluster: Cluster, route: str, type_: str) -> dict[str, Any]:
    status = (cluster.server.get_obj("modelroutes", "default", route) or {}).get("status") or {}
    return next((c for c in status.get("conditions") or () if c["type"] == type_), {})


def events(cluster: Cluster, route: str) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in cluster.server.all_of("events")
            if e["involvedObject"]["name"] == route
            and e["involvedObject"]["kind"] == "ModelRoute"]


async def start(cluster: Cluster) -> KubeApp:
    app = await cluster.start(door=DoorSettings(port=0))
    assert app.door is not None
    return app


async def test_a_modelroute_in_the_api_server_is_listed_and_served_by_a_candidate(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    await cluster.add_pod("pool-0", pod_agent(agent_factory), ip=POD_IP)
    app = await start(cluster)
    await cluster.apply(labelled("big", family="qwen", tier="big"))
    await cluster.apply(labelled("small", family="qwen", tier="small"))
    await cluster.api.create(ROUTES, "default", route_obj("chat"))
    await cluster.until("both Active", lambda: cluster.phase("big") == cluster.phase(
        "small") == "Active", 60)
    assert app.door is not None
    status, body, headers = await chat(app.door.port, "chat")
    assert status == 200, body
    assert (headers["x-route"], headers["x-route-claim"], headers["x-route-choice"]) == (
        "chat", "default/big", "warm")  # the preferred claim serves warm
    assert body["model"] == "big-model"
    status, listed, _ = await get(app.port, "/v1/modelroutes")
    assert status == 200
    [item] = listed["items"]
    assert [(c["claim"], c["model"], c["score"]) for c in item["candidates"]] == [
        ("default/big", "big-model", 60.0), ("default/small", "small-model", 55.0)]
    status, models, _ = await get(app.door.port, "/v1/models")
    found = {m["id"]: m for m in models["data"]}
    assert found["chat"]["route"] is True and found["chat"]["candidates"] == item["candidates"]
    # the status, read back from the API server, is the same listing
    await cluster.until("the route's status written", lambda: condition(
        cluster, "chat", "FailedScheduling").get("status") == "False")
    written = cluster.server.get_obj("modelroutes", "default", "chat")
    assert written is not None
    assert written["status"]["candidates"] == item["candidates"]
    assert (written["status"]["candidateCount"], written["status"]["preferred"]) == (
        2, "big-model")
    assert condition(cluster, "chat", "Accepted")["status"] == "True"
    assert written["status"]["observedGeneration"] == written["metadata"]["generation"]
    assert events(cluster, "chat") == []
    writes, passes = app.route_status.writes, app.route_status.passes
    app.route_status.mark()  # a pass over a status the object shows already writes nothing
    await cluster.until("another pass", lambda: app.route_status.passes > passes, 5)
    assert app.route_status.writes == writes


async def test_a_route_that_matches_no_claim_fails_scheduling_in_its_status_and_an_event(
        cluster: Cluster) -> None:
    app = await start(cluster)
    await cluster.apply(labelled("m", family="qwen"))
    await cluster.api.create(ROUTES, "default", route_obj("nothing", family="llama"))
    failed = await cluster.until("FailedScheduling True in the status", lambda: (
        c := condition(cluster, "nothing", "FailedScheduling")).get("status") == "True" and c)
    assert failed["reason"] == "NoMatchingModel" and "family=llama" in failed["message"]
    [event] = await cluster.until("the Event", lambda: events(cluster, "nothing"), 10)
    assert event[:2] == ("Warning", "FailedScheduling") and "family=llama" in event[2]
    assert app.door is not None
    started = time.monotonic()
    status, body, headers = await chat(app.door.port, "nothing")
    assert time.monotonic() - started < 1.0
    assert status == 503 and body["error"]["code"] == "no_matching_model", body
    assert "Retry-After" not in headers
    # a claim that matches comes: the route schedules again, in the status too
    await cluster.apply(labelled("llama", family="llama"))
    await cluster.until("FailedScheduling False", lambda: condition(
        cluster, "nothing", "FailedScheduling").get("status") == "False")
    written = cluster.server.get_obj("modelroutes", "default", "nothing")
    assert written is not None
    assert [c["claim"] for c in written["status"]["candidates"]] == ["default/llama"]
    _, models, _ = await get(app.door.port, "/v1/models")  # the door ranked it again too
    assert [c["claim"] for m in models["data"] if m["id"] == "nothing"
            for c in m["candidates"]] == ["default/llama"]
    assert len(events(cluster, "nothing")) == 1  # one Event per turn to failing


async def test_an_invalid_route_and_one_named_like_a_claims_model_are_reported_not_served(
        cluster: Cluster) -> None:
    app = await start(cluster)
    await cluster.apply(labelled("m", family="qwen"))
    await cluster.api.create(ROUTES, "default", route_obj("bad", qualityBias={
        "default": "high"}))
    await cluster.api.create(ROUTES, "default", route_obj("m-model"))
    await cluster.api.create(ROUTES, "default", route_obj("chat"))

    async def problems() -> dict[str, tuple[str, str]]:
        _, doc, _ = await get(app.port, "/v1/claims")
        return {p["name"]: (p["reason"], p["message"]) for p in doc["problems"]
                if p["kind"] == "ModelRoute"}

    await cluster.until("both refused", lambda: condition(cluster, "bad", "Accepted").get(
        "status") == "False" and condition(cluster, "m-model", "Accepted").get("status")
        == "False")
    found = await problems()
    assert found["bad"][0] == "InvalidRoute" and "spec.qualityBias" in found["bad"][1]
    assert found["m-model"] == ("Duplicate", "'m-model' is the modelName of claim default/m; "
                                             "give the route another name")
    assert set(found) == {"bad", "m-model"}
    assert (condition(cluster, "bad", "Accepted")["reason"],
            condition(cluster, "m-model", "Accepted")["reason"]) == ("InvalidRoute", "Duplicate")
    assert [e[1] for e in events(cluster, "bad")] == ["InvalidRoute"]
    assert [e[1] for e in await cluster.until("the Duplicate Event", lambda: events(
        cluster, "m-model"), 10)] == ["Duplicate"]
    _, listed, _ = await get(app.port, "/v1/modelroutes")
    assert [i["name"] for i in listed["items"]] == ["chat"]
    assert app.door is not None
    _, models, _ = await get(app.door.port, "/v1/models")
    assert [m["id"] for m in models["data"] if m.get("route")] == ["chat"]
    status, body, _ = await chat(app.door.port, "bad")
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    assert app.kube_desired.by_model("m-model") == ("default", "m")  # the claim keeps its name


async def test_a_cluster_without_the_modelroute_crd_still_reconciles_and_finds_it_later(
        cluster: Cluster) -> None:
    cluster.server.fail("GET", "modelroutes", 404, times=10**6)  # the CRD not applied yet
    app = await start(cluster)
    await cluster.apply(claim_obj("m"))
    await cluster.until("leading, the claims read", lambda: app.door is not None
                        and app._standby() is None and ("default", "m") in app.desired.claims,
                        10)
    cluster.server.faults.clear()  # the CRD is applied
    await cluster.api.create(ROUTES, "default", route_obj("chat"))
    await cluster.until("the route found once its CRD is served",
                        lambda: "chat" in app.kube_desired.routes, 20)
