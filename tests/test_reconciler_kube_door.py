"""The front door on Kubernetes, end to end: the reconciler against the kmock API server
(``tests.kube_api``), real agents with simulated engines as pool Pods, and clients over real
sockets through the door.

The pool Pods here have the IP 127.0.0.2 while the agent's own address is 127.0.0.1, and the
agents and engines listen on every address as in a cluster: an answer proves the door reached
the engine at the Pod's IP and the port of the route the AIBrix gateway reads from the Pod
annotation, not at some local address."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from reconciler.core import CoreSettings
from reconciler.door.settings import DoorSettings
from reconciler.kube.api import DEPLOYMENTS, connect
from reconciler.kube.app import KubeApp, KubeSettings
from tests.harness import AgentProcess, free_port_block
from tests.test_reconciler_kube import (
    CARD,
    Cluster,
    claim_obj,
    leading,
    replica,
    running_cluster,
    stop_replicas,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]
POD_IP = "127.0.0.2"
CHAT = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path) as made:
        yield made


def pod_agent(factory: Callable[..., AgentProcess]) -> AgentProcess:
    """A pool Pod's agent: it and its engines listen on every address, as in a cluster."""
    return factory(restart_delays="0.05", engine_host="0.0.0.0",
                   extra_args=[*CARD, "--host", "0.0.0.0", "--insecure-no-auth"])


async def chat(port: int, model: str) -> tuple[int, Any, Mapping[str, str]]:
    async with aiohttp.ClientSession() as http, http.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": model, "messages": CHAT, "max_tokens": 4}) as resp:
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


async def get(port: int, path: str) -> tuple[int, Any, Mapping[str, str]]:
    async with aiohttp.ClientSession() as http, http.get(
            f"http://127.0.0.1:{port}{path}") as resp:
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


def access(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def start_with_door(cluster: Cluster, log: Path) -> KubeApp:
    app = await cluster.start(door=DoorSettings(port=0, access_log=str(log)))
    assert app.door is not None
    return app


async def test_a_request_through_the_door_on_kubernetes_reaches_the_engine_at_the_pod_ip(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    await cluster.add_pod("pool-0", pod_agent(agent_factory), ip=POD_IP)
    log = tmp_path / "access.log"
    app = await start_with_door(cluster, log)
    await cluster.apply(claim_obj("door"))
    route = await cluster.until("the gateway's route active", lambda: (
        r := cluster.route("pool-0", "door")) is not None and r["state"] == "active" and r)
    assert app.door is not None and app.door.port > 0  # listening before it led
    status, body, _ = await chat(app.door.port, "door-model")
    assert status == 200, body
    assert body["model"] == "door-model" and body["choices"][0]["message"]["content"]
    line = await cluster.until("the access line", lambda: access(log) and access(log)[-1], 5)
    assert (line["status"], line["claim"], line["upstream"]) == (
        200, "default/door", f"default/pool-0 {POD_IP}:{route['port']}")
    status, listed, _ = await get(app.door.port, "/v1/models")
    assert status == 200 and [(m["id"], m["state"]) for m in listed["data"]] == [
        ("door-model", "active")]


async def test_a_request_for_a_sleeping_model_on_kubernetes_wakes_it_through_the_door(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    await cluster.api.patch(DEPLOYMENTS, "default", "warm-runtime-pool", {"metadata": {
        "annotations": {"claim.model.aibrix.ai/pool-policy":
                        '{"lifecycle":{"sleepAfterSeconds":1}}'}}})
    await cluster.add_pod("pool-0", pod_agent(agent_factory), ip=POD_IP)
    log = tmp_path / "access.log"
    app = await start_with_door(cluster, log)
    await cluster.apply(claim_obj("sleepy", {"--sim-wake-seconds": "1"}))
    await cluster.until("sleepy asleep", lambda: cluster.phase("sleepy") == "Sleeping")
    assert (cluster.route("pool-0", "sleepy") or {}).get("state") == "sleeping"
    assert app.door is not None
    request = asyncio.ensure_future(chat(app.door.port, "sleepy-model"))
    # held for the wake, it counts in flight for the idle check the core runs before a sleep
    await cluster.until("the request held in flight",
                        lambda: app.deps.reader.in_flight("sleepy-model") == 1, 10)
    status, body, _ = await request
    assert status == 200, body
    assert body["model"] == "sleepy-model"
    assert app.deps.reader.in_flight("sleepy-model") == 0
    line = await cluster.until("the access line", lambda: access(log) and access(log)[-1], 5)
    assert (line["status"], line["held_for"]) == (200, "wake")
    assert line["upstream"].startswith(f"default/pool-0 {POD_IP}:")
    events = [e["reason"] for e in cluster.server.all_of("events")
              if e["involvedObject"]["name"] == "sleepy"]
    assert "Waking" in events and "Woken" in events


async def test_a_standby_replicas_door_answers_503_until_it_leads(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    await cluster.add_pod("pool-0", pod_agent(agent_factory), ip=POD_IP)
    base = free_port_block(4)
    ports = {"r1": (base, base + 1), "r2": (base + 2, base + 3)}  # (API, door)
    procs = {n: replica(cluster.config, n, tmp_path / f"{n}.log", api, "--door-port", str(door),
                        "--door-access-log", "off") for n, (api, door) in ports.items()}
    try:
        await cluster.apply(claim_obj("shared"))
        await cluster.until("shared Active", lambda: cluster.phase("shared") == "Active",
                            timeout=60)
        lease = cluster.server.get_obj("leases", "default", "modelclaim-controller")
        assert lease is not None
        leader = lease["spec"]["holderIdentity"]
        standby = next(n for n in procs if n != leader)
        await cluster.until("both replicas serving metrics", lambda: leading(ports[leader][0])
                            == 1.0 and leading(ports[standby][0]) == 0.0)
        door = ports[standby][1]
        status, body, headers = await chat(door, "shared-model")
        assert status == 503, body
        assert headers["Retry-After"] == "1" and headers["Connection"].lower() == "close"
        assert (body["error"]["type"], body["error"]["code"]) == ("service_unavailable",
                                                                  "not_leading")
        assert standby in body["error"]["message"] and "not leading" in body["error"]["message"]
        status, body, _ = await get(door, "/v1/models")
        assert status == 503 and body["error"]["code"] == "not_leading"
        status, body, headers = await get(door, "/healthz")
        assert (status, body["status"], headers["Retry-After"]) == (503, "standby", "1")
        status, body, _ = await chat(ports[leader][1], "shared-model")
        assert status == 200 and body["model"] == "shared-model", body
        assert (await get(ports[leader][1], "/healthz"))[:2] == (200, {"status": "ok"})

        await stop_replicas([procs[leader]])  # it releases the Lease: the standby leads
        answers: list[tuple[int, str | None]] = []
        deadline = time.monotonic() + 30
        while not answers or answers[-1][0] != 200:
            assert time.monotonic() < deadline, f"the new leader's door never served: {answers}"
            status, body, _ = await chat(door, "shared-model")
            answers.append((status, (body.get("error") or {}).get("code")))
            if status != 200:
                await asyncio.sleep(0.1)
        assert set(answers) <= {(503, "not_leading"), (200, None)}, answers
        assert body["model"] == "shared-model"
        engines = cluster.engines("shared-model")
        assert len(engines) == 1 and engines[0][1]["restart_count"] == 0
    finally:
        await stop_replicas(procs.values())


async def test_a_door_port_in_use_stops_the_replica_with_a_clear_message(
        cluster: Cluster, tmp_path: Path) -> None:
    api = free_port_block(2)
    busy = api + 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        proc = replica(cluster.config, "r1", tmp_path / "r1.log", api, "--door-port", str(busy))
        try:
            code = await asyncio.to_thread(proc.wait, 30)
        finally:
            await stop_replicas([proc])
    log = (tmp_path / "r1.log").read_text()
    assert code == 5 and f"--door-port {busy}: 127.0.0.1:{busy} is already in use" in log, log
    assert "Traceback" not in log and "Unclosed" not in log


async def test_a_replica_whose_port_is_in_use_leaves_no_session_open(cluster: Cluster) -> None:
    """``run`` raises OSError (the CLI says which port) with its API client's session closed:
    no "Unclosed client session" when the process exits."""
    def open_sessions() -> set[int]:
        gc.collect()
        return {id(o) for o in gc.get_objects()
                if isinstance(o, aiohttp.ClientSession) and not o.closed}

    before = open_sessions()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        api = await connect(str(cluster.config))
        app = KubeApp(KubeSettings(CoreSettings(host="127.0.0.1", port=taken.getsockname()[1]),
                                   leader_election=False,
                                   door=DoorSettings(port=0, access_log="off")), api)
        with pytest.raises(OSError):
            await app.run()
    assert open_sessions() - before == set()
