"""The reconciler on Kubernetes at fleet scale: 10,000 claims over 1,000 pool Pods.

Three processes besides this one, so the reconciler is measured alone:

* the API server stand-in (``bench.kube_server``: kmock with resource versions, watches,
  bookmarks, the status subresource, finalizers);
* 1,000 agent stand-ins (``bench.fake_agents``: one process, one loopback address each,
  speaking the agent's snapshot, activate, kv-limit and events API; an engine is active at once);
* the reconciler, as deployed: ``runtime-agent reconcile --kubernetes --kubeconfig ...``.

Figures: the time to converge (every claim's engine activated), then with nothing changing the
reconciler's CPU (psutil, % of one core), its RSS, and the API requests per second it makes;
then ``--samples`` claims applied one at a time: the time from the create request to the agent's
activate call (both wall clock, one host).

    python -m bench.bench_kube [--agents 1000] [--claims 10000] [--samples 100] [--idle 60]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml  # type: ignore[import-untyped]

from bench.common import Result, fmt_summary, log, run_main, summary_ms
from bench.fake_agents import agent_ip
from reconciler.kube.api import CLAIMS, DEPLOYMENTS, PODS, KubeApi, connect

ROOT = Path(__file__).resolve().parent.parent
API_PORT, AGENT_PORT, CONTROL_PORT, RECONCILER_PORT = 18443, 18480, 18479, 18481
POOL = {"claim.model.aibrix.ai/pool": "pool-a", "claim.model.aibrix.ai/enabled": "true"}
GOAL_P99_MS = 1000.0
GOAL_IDLE_PCT = 5.0


def claim(name: str) -> dict[str, Any]:
    return {"apiVersion": "model.aibrix.ai/v1alpha1", "kind": "ModelClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"modelName": f"{name}-model", "podSelector": {"matchLabels": {
                "claim.model.aibrix.ai/pool": "pool-a"}},
                "artifactURL": f"huggingface://bench/{name}", "engine": "vllm",
                "perGPU": {"maximumFootprint": "5Gi", "kvFloor": "1Gi"},
                "engineConfig": {"args": {"--max-model-len": "2048"}}}}


def pod(i: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"pool-{i:04d}", "namespace": "default", "labels": dict(POOL)},
            "spec": {"containers": [{"name": "aibrix-runtime", "ports": [
                {"name": "runtime", "containerPort": AGENT_PORT}]}]},
            "status": {"phase": "Running", "podIP": agent_ip(i)}}


def spawn(args: list[str], logfile: Path) -> subprocess.Popen[bytes]:
    with logfile.open("ab") as out:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=out,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)


async def wait_port(port: int, host: str = "127.0.0.1", timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        return await resp.json()


async def in_batches(coros: list[Any], size: int = 64) -> None:
    for i in range(0, len(coros), size):
        await asyncio.gather(*coros[i:i + size])


class Bench:
    def __init__(self, tmp: Path, agents: int, claims: int) -> None:
        self.tmp, self.agents, self.claims = tmp, agents, claims
        self.procs: list[subprocess.Popen[bytes]] = []
        self.api: KubeApi | None = None

    async def start(self) -> None:
        self.procs.append(spawn(["-m", "bench.kube_server", "--port", str(API_PORT)],
                                self.tmp / "api.log"))
        self.procs.append(spawn(["-m", "bench.fake_agents", "--count", str(self.agents),
                                 "--port", str(AGENT_PORT), "--control", str(CONTROL_PORT),
                                 "--card-gib", "80"], self.tmp / "agents.log"))
        await wait_port(API_PORT)
        await wait_port(CONTROL_PORT)
        config = self.tmp / "kubeconfig"
        config.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "bench",
            "clusters": [{"name": "b", "cluster": {"server": f"http://127.0.0.1:{API_PORT}"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "bench", "context": {"cluster": "b", "user": "u"}}]}))
        self.api = api = await connect(str(config))
        await api.create(DEPLOYMENTS, "default", {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "warm-runtime-pool", "namespace": "default",
                         "labels": dict(POOL)},
            "spec": {"template": {"metadata": {"labels": dict(POOL)}}}})
        await in_batches([api.create(PODS, "default", pod(i)) for i in range(self.agents)])
        self.reconciler = spawn(["-m", "runtime_agent.cli", "reconcile", "--kubernetes",
                                 "--kubeconfig", str(config), "--no-leader-election",
                                 "--host", "127.0.0.1", "--port", str(RECONCILER_PORT),
                                 "--log-level", "warning"], self.tmp / "reconciler.log")
        self.procs.append(self.reconciler)
        await wait_port(RECONCILER_PORT)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    async def measure(self, samples: int, idle_s: float) -> dict[str, Any]:
        assert self.api is not None
        api = self.api
        out: dict[str, Any] = {}
        proc = psutil.Process(self.reconciler.pid)
        async with aiohttp.ClientSession() as http:
            ctl = f"http://127.0.0.1:{CONTROL_PORT}"
            cpu0, t0 = proc.cpu_times(), time.monotonic()
            await in_batches([api.create(CLAIMS, "default", claim(f"c{i:05d}"))
                              for i in range(self.claims)])
            out["apply_s"] = time.monotonic() - t0
            log(f"kube: {self.claims} claims applied in {out['apply_s']:.1f} s")
            while True:
                done = len(await get_json(http, f"{ctl}/activations"))
                if done >= self.claims:
                    break
                if time.monotonic() - t0 > 1800:
                    raise TimeoutError(f"only {done} of {self.claims} activated")
                await asyncio.sleep(1.0)
            out["converge_s"] = time.monotonic() - t0
            c1 = proc.cpu_times()
            out["converge_cpu_s"] = (c1.user + c1.system) - (cpu0.user + cpu0.system)
            log(f"kube: all {self.claims} activated {out['converge_s']:.1f} s after the first "
                f"apply (reconciler CPU {out['converge_cpu_s']:.1f} s)")
            # settle: statuses, routes and KV limits written; then nothing changes
            last, quiet = -1, 0
            while quiet < 5:
                version = (await get_json(http, f"http://127.0.0.1:{API_PORT}/stats"))["version"]
                quiet = quiet + 1 if version == last else 0
                last = version
                await asyncio.sleep(2.0)
            out["settle_s"] = time.monotonic() - t0
            stats0 = (await get_json(http, f"http://127.0.0.1:{API_PORT}/stats"))["counts"]
            agents0 = await get_json(http, f"{ctl}/stats")
            c2, w2 = proc.cpu_times(), time.monotonic()
            await asyncio.sleep(idle_s)
            c3, w3 = proc.cpu_times(), time.monotonic()
            stats1 = (await get_json(http, f"http://127.0.0.1:{API_PORT}/stats"))["counts"]
            agents1 = await get_json(http, f"{ctl}/stats")
            span = w3 - w2
            out["idle_cpu_pct"] = ((c3.user + c3.system) - (c2.user + c2.system)) / span * 100
            out["rss_mib"] = proc.memory_info().rss / 2**20
            out["idle_api_rps"] = (sum(stats1.values()) - sum(stats0.values())) / span
            out["idle_agent_rps"] = (sum(agents1.values()) - sum(agents0.values())) / span
            out["idle_api_calls"] = {k: stats1.get(k, 0) - stats0.get(k, 0) for k in stats1}
            log(f"kube: idle CPU {out['idle_cpu_pct']:.2f}% of a core, RSS "
                f"{out['rss_mib']:.0f} MiB, {out['idle_api_rps']:.2f} API requests/s, "
                f"{out['idle_agent_rps']:.1f} agent requests/s")
            latencies = []
            for i in range(samples):
                name = f"s{i:04d}"
                sent = time.time()
                await api.create(CLAIMS, "default", claim(name))
                deadline = time.monotonic() + 30
                while True:
                    acts = await get_json(http, f"{ctl}/activations")
                    if f"{name}-model" in acts:
                        latencies.append(acts[f"{name}-model"] - sent)
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name} was never activated")
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)
            out["latency"] = latencies
            out["total_api_calls"] = stats1
        return out


def run(agents: int, claims: int, samples: int, idle_s: float) -> Result:
    tmp = Path(os.environ.get("BENCH_TMP", "/tmp")) / f"bench-kube-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    bench = Bench(tmp, agents, claims)

    async def go() -> dict[str, Any]:
        try:
            await bench.start()
            return await bench.measure(samples, idle_s)
        finally:
            if bench.api is not None:
                await bench.api.close()

    try:
        out = asyncio.run(go())
    finally:
        bench.stop()
    lat = summary_ms(out["latency"])
    passed = lat["p99"] <= GOAL_P99_MS and out["idle_cpu_pct"] <= GOAL_IDLE_PCT
    lines = [
        f"{claims} claims over {agents} pool Pods: applied in {out['apply_s']:.1f} s, every "
        f"engine activated {out['converge_s']:.1f} s after the first apply (reconciler CPU "
        f"{out['converge_cpu_s']:.1f} s), writes settled after {out['settle_s']:.1f} s",
        f"idle (nothing changes) over {idle_s:g} s: reconciler CPU {out['idle_cpu_pct']:.2f}% "
        f"of a core, RSS {out['rss_mib']:.0f} MiB, {out['idle_api_rps']:.2f} API requests/s "
        f"({out['idle_api_calls']}), {out['idle_agent_rps']:.1f} agent requests/s",
        f"create -> activate at that size: {fmt_summary(lat, ('min', 'p50', 'p90', 'p99', 'max'))}",
    ]
    return Result(
        figure=f"8. reconciler on Kubernetes ({claims} claims, {agents} Pods)",
        goal=f"create -> activate p99 <= {GOAL_P99_MS:g} ms; idle CPU <= {GOAL_IDLE_PCT:g}% "
             "(memory, API requests/s recorded)",
        measured=(f"p50 {lat['p50']:.0f} ms, p99 {lat['p99']:.0f} ms; idle CPU "
                  f"{out['idle_cpu_pct']:.2f}%, RSS {out['rss_mib']:.0f} MiB, "
                  f"{out['idle_api_rps']:.2f} API req/s idle"),
        passed=passed, details={"latency_ms": lat, **{k: v for k, v in out.items()
                                                       if k != "latency"}},
        lines=lines)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--claims", type=int, default=10000)
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--idle", type=float, default=60.0)
    args = p.parse_args()
    return run_main(lambda: run(args.agents, args.claims, args.samples, args.idle))


if __name__ == "__main__":
    sys.exit(main())
