"""The reconciler on Kubernetes, end to end: the API server stand-in (``tests.kube_api``, kmock's
emulator with resource versions, watches, the status subresource, finalizers, conflicts and 410
Gone), real agents with simulated engines as the pool's Pods, and the reconciler reached only
through the API server and the agents."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml  # type: ignore[import-untyped]

from reconciler.core import CoreSettings
from reconciler.kube.api import CLAIMS, DEPLOYMENTS, PODS, KubeApi, connect
from reconciler.kube.app import KubeApp, KubeSettings
from reconciler.kube.status import FINALIZER
from tests.harness import AgentProcess, free_port
from tests.kube_api import ApiServer
from tests.waits import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]
ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
CARD = ["--simulate-gpus", "1x16GiB", "--gpu-reserve", "1GiB"]
POOL = {"claim.model.aibrix.ai/pool": "pool-a", "claim.model.aibrix.ai/enabled": "true"}
SIM = {"--sim-startup-seconds": "0.2", "--sim-memory-bytes": str(GiB)}
SEED_CLAIMS = [d for d in yaml.safe_load_all((ROOT / "samples/modelclaim/modelclaims.yaml")
                                             .read_text()) if d]


def claim_obj(name: str, args: dict[str, str] | None = None, footprint: str = "6Gi") -> dict[str, Any]:
    return {"apiVersion": "model.aibrix.ai/v1alpha1", "kind": "ModelClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"modelName": f"{name}-model", "podSelector": {"matchLabels": {
                "claim.model.aibrix.ai/pool": "pool-a"}},
                "artifactURL": f"huggingface://test/{name}", "engine": "vllm",
                "perGPU": {"maximumFootprint": footprint, "kvFloor": "1Gi"},
                "engineConfig": {"args": {**SIM, **(args or {})}}}}


def pod_obj(name: str, agent: AgentProcess, ip: str = "127.0.0.1") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": dict(POOL)},
            "spec": {"containers": [{"name": "aibrix-runtime", "ports": [
                {"name": "runtime", "containerPort": agent.port}]}]},
            "status": {"phase": "Running", "podIP": ip}}


def task_dump() -> str:
    """Every task of the running loop and the chain of awaits it is suspended in (innermost
    last): which await never returned."""
    lines = []
    for task in asyncio.all_tasks():
        if task is asyncio.current_task():
            continue
        lines.append(f"{task.get_name()}:")
        coro: Any = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) \
                or getattr(coro, "ag_frame", None)
            if frame is not None:
                code = frame.f_code
                lines.append(f"  {code.co_filename}:{frame.f_lineno} {code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) \
                or getattr(coro, "ag_await", None)
    return "\n".join(lines)


def kubeconfig(path: Path, url: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "test", "user": {"token": "test-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}]}))
    return path


class Cluster:
    """The API server stand-in, a client to it, and pool Pods backed by real agents."""

    def __init__(self, server: ApiServer, url: str, api: KubeApi, config: Path) -> None:
        self.server, self.url, self.api, self.config = server, url, api, config
        self.agents: dict[str, AgentProcess] = {}
        self.app: KubeApp | None = None

    async def add_pod(self, name: str, agent: AgentProcess, ip: str = "127.0.0.1") -> None:
        self.agents[name] = agent
        await self.api.create(PODS, "default", pod_obj(name, agent, ip))

    async def apply(self, obj: dict[str, Any]) -> None:
        await self.api.create(CLAIMS, "default", obj)

    def claim(self, name: str) -> dict[str, Any] | None:
        return self.server.get_obj("modelclaims", "default", name)

    def pod(self, name: str) -> dict[str, Any] | None:
        return self.server.get_obj("pods", "default", name)

    def phase(self, name: str) -> str | None:
        obj = self.claim(name)
        return ((obj or {}).get("status") or {}).get("phase")

    def route(self, pod: str, claim: str) -> dict[str, Any] | None:
        value = ((self.pod(pod) or {}).get("metadata", {}).get("annotations") or {}).get(
            f"route.claim.model.aibrix.ai/{claim}")
        return json.loads(value) if value else None

    def engines(self, model: str) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for name, agent in self.agents.items():
            if agent.proc is None or agent.proc.poll() is not None:
                continue
            out += [(name, m) for m in agent.client.snapshot()["models"]
                    if m["model_name"] == model]
        return out

    async def until(self, what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
        return await until(what, check, timeout, explain=self._claims, blocking=True)

    def _claims(self) -> str:
        claims = {o["metadata"]["name"]: (o.get("status") or {})
                  for o in self.server.all_of("modelclaims")}
        return f"claims: {claims}"

    async def start(self, **settings: Any) -> KubeApp:
        api = await connect(str(self.config))
        core = CoreSettings(port=0, resync_interval=60.0)
        self.app = KubeApp(KubeSettings(core, kubeconfig=str(self.config),
                                        leader_election=False, **settings), api)
        self._run = asyncio.ensure_future(self.app.run())
        return self.app

    async def stop(self) -> None:
        """Stop the replica; one that has not stopped within 60 s fails the test with every
        task's stack (which await never returned)."""
        if self.app is not None:
            self.app.stop()
            done, _ = await asyncio.wait({self._run}, timeout=60)
            if not done:
                raise AssertionError("the replica did not stop within 60 s; its tasks:\n"
                                     + task_dump())
            self.app = None
            self._run.result()


@contextlib.asynccontextmanager
async def running_cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """The API server stand-in with the pool's Deployment; every replica stopped at the end."""
    async with ApiServer(bookmark_interval=0.5) as server, kmock.Server(server) as http:
        url = str(http.url).rstrip("/")
        config = kubeconfig(tmp_path / "kubeconfig", url)
        api = await connect(str(config))
        made = Cluster(server, url, api, config)
        await api.create(DEPLOYMENTS, "default", {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "warm-runtime-pool", "namespace": "default",
                         "labels": dict(POOL)},
            "spec": {"template": {"metadata": {"labels": dict(POOL)}}}})
        try:
            yield made
        finally:
            await made.stop()
            await api.close()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path) as made:
        yield made


def agent_for(factory: Callable[..., AgentProcess]) -> AgentProcess:
    return factory(restart_delays="0.05", extra_args=CARD)


async def test_the_seeds_sample_claims_become_active_with_finalizers_and_conditions(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    await cluster.add_pod("pool-0", agent_for(agent_factory))
    await cluster.start()
    for obj in SEED_CLAIMS:
        await cluster.apply(obj)
    for obj in SEED_CLAIMS:
        name = obj["metadata"]["name"]
        await cluster.until(f"{name} Active", lambda n=name: cluster.phase(n) == "Active")
        claim = cluster.claim(name)
        assert claim is not None and FINALIZER in claim["metadata"]["finalizers"]
        status = claim["status"]
        assert status["readyReplicas"] == 1 and status["instances"][0]["pod"] == "pool-0"
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "ModelClaimActive"
        assert ready["observedGeneration"] == claim["metadata"]["generation"]
        route = cluster.route("pool-0", name)
        assert route is not None and route["state"] == "active"
        assert route["model"] == obj["spec"]["modelName"] and route["port"] > 0
    events = cluster.server.all_of("events")
    assert any(e["reason"] == "Activated" and e["involvedObject"]["name"] == "qwen3-0-6b"
               for e in events)


async def test_claims_without_per_gpu_are_measured_alone_on_kubernetes_too(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    """No perGPU on Kubernetes (the reconciler reads no artifact there): placed on a Pod of its
    own, measured, given a KV limit by the measured figures; a declared claim goes to the
    other Pod (the fewest awake), and a second claim without perGPU then waits, saying why."""
    for pod in ("pool-0", "pool-1"):
        await cluster.add_pod(pod, agent_for(agent_factory))
    await cluster.start()

    def unmeasured(name: str) -> dict[str, Any]:
        obj = claim_obj(name)
        del obj["spec"]["perGPU"]
        return obj

    await cluster.apply(unmeasured("u1"))
    await cluster.until("u1 Active", lambda: cluster.phase("u1") == "Active")
    ((first, engine),) = cluster.engines("u1-model")
    assert engine["kv_limit_applied_bytes"] is not None  # set from its measured figures
    await cluster.apply(claim_obj("d"))
    await cluster.until("d Active", lambda: cluster.phase("d") == "Active")
    ((second, _),) = cluster.engines("d-model")
    assert second != first
    await cluster.apply(unmeasured("u2"))

    def waits() -> bool:
        status = (cluster.claim("u2") or {}).get("status") or {}
        scheduled: dict[str, Any] = next((c for c in status.get("conditions", [])
                          if c["type"] == "Scheduled"), {})
        return status.get("phase") == "Pending" and "measured on GPUs no other engine uses" \
            in scheduled.get("message", "")

    await cluster.until("u2 waits to be measured", waits)
    assert cluster.engines("u2-model") == []


async def test_a_claim_is_written_active_only_once_its_route_is_active(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    """The gateway routes by the Pod annotation: whoever waits for Active and then sends a
    request must find the engine on the route. The API server refuses the first two patches
    that put the route on (the publisher retries a second later); Active must wait for them."""
    await cluster.add_pod("pool-0", agent_for(agent_factory))
    refused: list[str] = []

    def state(obj: dict[str, Any] | None) -> str | None:
        value = ((obj or {}).get("metadata", {}).get("annotations") or {}).get(
            "route.claim.model.aibrix.ai/late")
        return json.loads(value)["state"] if value else None

    def refuse(res: tuple[str, str, str], old: dict[str, Any] | None,
               new: dict[str, Any]) -> str | None:
        if res[2] == "pods" and state(new) == "active" != state(old) and len(refused) < 2:
            refused.append("route")
            return "refused by the test"
        return None

    cluster.server.validate = refuse
    await cluster.start()
    await cluster.apply(claim_obj("late"))
    await cluster.until("late Active", lambda: cluster.phase("late") == "Active")
    # the API server's history, in order: the route's state when the claim first read Active
    history = sorted((version, res[2], obj) for res, entries in cluster.server.log.items()
                     for version, _, obj, _ in entries if res[2] in ("pods", "modelclaims"))
    route = None
    for _, plural, obj in history:
        if plural == "pods":
            route = state(obj)
        elif (obj.get("status") or {}).get("phase") == "Active":
            break
    assert route == "active" and refused == ["route", "route"]


async def test_the_route_is_active_only_once_the_engine_is_ready(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_for(agent_factory)
    await cluster.add_pod("pool-0", agent)
    await cluster.start()
    await cluster.apply(claim_obj("slow", {"--sim-startup-seconds": "2"}))
    seen: list[tuple[str, bool]] = []

    def observe() -> bool:
        route = cluster.route("pool-0", "slow")
        engines = cluster.engines("slow-model")
        ready = bool(engines) and engines[0][1]["ready"]
        if route is not None:
            seen.append((route["state"], ready))
            if route["state"] == "active":
                assert ready, "the route says active while the engine is not ready"
                assert route["port"] == engines[0][1]["port"]
            else:
                assert route["port"] == 0
        return route is not None and route["state"] == "active"

    await cluster.until("an active route", observe)
    assert ("activating", False) in seen  # it was routed as starting, with no port


async def test_a_wake_annotation_wakes_the_model_and_is_removed(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    await cluster.api.patch(DEPLOYMENTS, "default", "warm-runtime-pool", {"metadata": {
        "annotations": {"claim.model.aibrix.ai/pool-policy":
                        '{"lifecycle":{"sleepAfterSeconds":1}}'}}})
    await cluster.add_pod("pool-0", agent_for(agent_factory))
    await cluster.start()
    await cluster.apply(claim_obj("sleepy"))
    await cluster.until("sleepy asleep", lambda: cluster.phase("sleepy") == "Sleeping")
    assert (cluster.route("pool-0", "sleepy") or {}).get("state") == "sleeping"
    key = "wake.modelclaim.aibrix.ai/sleepy"
    await cluster.api.patch(PODS, "default", "pool-0", {"metadata": {"annotations": {
        key: "2026-01-01T00:00:00Z"}}})
    await cluster.until("the engine awake", lambda: any(
        m["phase"] == "active" for _, m in cluster.engines("sleepy-model")))
    await cluster.until("the wake request removed", lambda: key not in (
        cluster.pod("pool-0") or {})["metadata"].get("annotations", {}))
    events = [e["reason"] for e in cluster.server.all_of("events")
              if e["involvedObject"]["name"] == "sleepy"]
    assert "Waking" in events and "Woken" in events


async def test_a_deleted_pod_loses_its_claim_to_another_pod(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    first, second = agent_for(agent_factory), agent_for(agent_factory)
    await cluster.add_pod("pool-0", first)
    await cluster.start()
    await cluster.apply(claim_obj("mover"))
    await cluster.until("mover Active on pool-0", lambda: cluster.phase("mover") == "Active")
    await cluster.add_pod("pool-1", second)
    await cluster.api.delete(PODS, "default", "pool-0")
    first.cleanup()  # the Pod's containers go with it
    await cluster.until("mover Active on pool-1", lambda: cluster.phase("mover") == "Active"
                        and cluster.claim("mover")["status"]["instances"][0]["pod"] == "pool-1")
    assert [name for name, _ in cluster.engines("mover-model")] == ["pool-1"]
    assert cluster.route("pool-1", "mover")["state"] == "active"


async def test_a_deleted_claim_is_drained_behind_its_finalizer(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_for(agent_factory)
    await cluster.add_pod("pool-0", agent)
    await cluster.start()
    await cluster.apply(claim_obj("gone"))
    await cluster.until("gone Active", lambda: cluster.phase("gone") == "Active")
    await cluster.api.delete(CLAIMS, "default", "gone")
    held = cluster.claim("gone")
    assert held is not None and held["metadata"].get("deletionTimestamp"), \
        "the finalizer holds the deletion"
    await cluster.until("the claim gone", lambda: cluster.claim("gone") is None)
    assert cluster.engines("gone-model") == [], "the engine stopped before the object went"
    assert cluster.route("pool-0", "gone") is None


async def test_a_status_conflict_is_read_again_and_retried(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    await cluster.add_pod("pool-0", agent_for(agent_factory))
    cluster.server.fail("PATCH", "/status", 409, times=2)
    app = await cluster.start()
    await cluster.apply(claim_obj("contested"))
    await cluster.until("contested Active", lambda: cluster.phase("contested") == "Active")
    assert app.kube_store.conflicts >= 2


async def test_a_lost_watch_history_relists_and_a_failed_list_deletes_nothing(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess]) -> None:
    await cluster.add_pod("pool-0", agent_for(agent_factory))
    app = await cluster.start()
    await cluster.apply(claim_obj("steady"))
    await cluster.until("steady Active", lambda: cluster.phase("steady") == "Active")
    lists = [i.lists for i in app.informers]
    await cluster.apply(claim_obj("later", footprint="4Gi"))
    cluster.server.compact()
    cluster.server.fail("GET", "/modelclaims", 500, times=3)
    cluster.server.drop_watches()
    await cluster.until("later Active after the relist", lambda: cluster.phase("later")
                        == "Active", timeout=45)
    assert app.informers[0].lists > lists[0], "410 Gone made the claims informer list again"
    assert [m["phase"] for _, m in cluster.engines("steady-model")] == ["active"], \
        "failed lists stopped nothing"


def leading(port: int) -> float | None:
    """The replica's ``reconciler_leader`` gauge (None: it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith("reconciler_leader ")), None)
    return float(line.split()[1]) if line else None


def replica(config: Path, name: str, log: Path, port: int,
                *extra: str) -> subprocess.Popen[bytes]:
    """A replica as ``runtime-agent reconcile --kubernetes`` runs it (``extra``: more flags)."""
    argv = [sys.executable, "-m", "runtime_agent.cli", "reconcile", "--kubernetes",
            "--kubeconfig", str(config), "--identity", name, "--port", str(port),
            "--host", "127.0.0.1", "--lease-duration", "3", "--renew-deadline", "2",
            "--retry-period", "0.5", *extra]
    with log.open("ab") as out:
        return subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=out,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)


async def stop_replicas(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each replica still running; SIGKILL its group after 15 s. The wait leaves this
    loop free: the API server stand-in runs on it, and a stopping leader writes its last
    statuses and releases the Lease there."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def test_a_killed_leader_is_replaced_without_placing_anything_twice(
        cluster: Cluster, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    for i in range(2):
        await cluster.add_pod(f"pool-{i}", agent_for(agent_factory))
    ports = {n: free_port() for n in ("r1", "r2")}
    procs = {n: replica(cluster.config, n, tmp_path / f"{n}.log", ports[n]) for n in ports}
    try:
        for i in range(3):
            await cluster.apply(claim_obj(f"m{i}", footprint="3Gi"))
        for i in range(3):
            await cluster.until(f"m{i} Active", lambda i=i: cluster.phase(f"m{i}") == "Active",
                                timeout=60)
        lease = cluster.server.get_obj("leases", "default", "modelclaim-controller")
        leader = lease["spec"]["holderIdentity"]
        standby = next(n for n in procs if n != leader)
        await cluster.until("both replicas serving metrics", lambda: leading(ports[leader])
                            == 1.0 and leading(ports[standby]) == 0.0)
        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait(10)
        await cluster.apply(claim_obj("m3", footprint="3Gi"))
        await cluster.until("m3 Active under the new leader",
                            lambda: cluster.phase("m3") == "Active", timeout=60)
        lease = cluster.server.get_obj("leases", "default", "modelclaim-controller")
        assert lease["spec"]["holderIdentity"] not in (None, leader)
        for i in range(4):
            engines = cluster.engines(f"m{i}-model")
            assert len(engines) == 1, f"m{i} runs {len(engines)} engines"
            assert engines[0][1]["restart_count"] == 0
        starts = [e["model"] for agent in cluster.agents.values()
                  for e in agent.client.events(0)["events"] if e["from"] == "activating"]
        assert sorted(starts) == [f"m{i}-model" for i in range(4)], "a model started twice"
    finally:
        await stop_replicas(procs.values())

