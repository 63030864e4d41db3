"""A pool rollout under steady load (issue 25, item 4): every Pod replaced by a new one, one at a
time with a surge of one (``maxSurge: 1, maxUnavailable: 0``), three models served through the
front door the whole time.

The API server stand-in (``tests.kube_api`` through kmock), the reconciler with its door in
this process (``KubeApp``), and one real agent per Pod (simulated GPU of 16 GiB, simulated
engines that take ``--start-s`` to start, ``--call-s`` a call). Two runs on the same setup:

* ``make-before-break`` (ours, as ``deploy/warm-runtime-pool.yaml`` deploys it): the old Pod is
  deleted with its grace period (a finalizer holds it, as the kubelet's ``preStop`` does), its
  ``runtime-agent wait-drained`` runs, and once it returns the Pod and its agent go;
* ``stop-with-pod`` (the seed's: "Changing the Pod template ... replaces the Pods. Their
  engines stop with them, and the controller places their claims again"): the old Pod is
  deleted at once and its agent and engines end with it.

Per model: calls answered, calls failed (not 200), the longest time between two answers (the
gap in service) and the longest call (a call held while its model could not serve).

    python -m bench.bench_rollout [--pods 3] [--start-s 1.5] [--call-s 0.1] [--callers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from reconciler.door.settings import DoorSettings
from reconciler.kube.api import PODS
from tests.harness import AgentProcess
from tests.test_reconciler_kube import CARD, Cluster, claim_obj, running_cluster

MODES = ("make-before-break", "stop-with-pod")
CHAT = [{"role": "user", "content": "Say hello."}]


def new_agent(tmp: Path, name: str) -> AgentProcess:
    agent = AgentProcess(tmp / name, restart_delays="0.05", engine_host="0.0.0.0",
                         extra_args=[*CARD, "--host", "0.0.0.0", "--insecure-no-auth"])
    agent.start()
    return agent


async def caller(http: aiohttp.ClientSession, port: int, model: str, stop: asyncio.Event,
                 answers: list[tuple[float, int, float]]) -> None:
    while not stop.is_set():
        sent = time.monotonic()
        try:
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                    "model": model, "messages": CHAT, "max_tokens": 4}) as resp:
                await resp.read()
                status = resp.status
        except aiohttp.ClientError:
            status = 0
        answers.append((time.monotonic(), status, time.monotonic() - sent))


async def replace_pod(cluster: Cluster, tmp: Path, old: str, new: str, mode: str) -> None:
    """The rollout's step for one Pod: the new one first (the surge), then the old one goes."""
    await cluster.add_pod(new, new_agent(tmp, new))
    await cluster.until(f"{new} an agent", lambda: cluster.app is not None
                        and cluster.app.desired.agent(f"default/{new}") is not None, 60)
    agent = cluster.agents[old]
    if mode == "stop-with-pod":
        await cluster.api.delete(PODS, "default", old)
        agent.cleanup()  # the container ends: the agent and its engines with it
        return
    await cluster.api.patch(PODS, "default", old, {"metadata": {"finalizers": ["bench/prestop"]}})
    await cluster.api.delete(PODS, "default", old)  # Terminating: its grace period
    hook = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "runtime_agent.cli", "wait-drained", "--timeout", "120",
        "--url", agent.url, stdout=asyncio.subprocess.DEVNULL)
    await hook.wait()  # the preStop returned: no engine runs there
    await cluster.api.patch(PODS, "default", old, {"metadata": {"finalizers": []}})
    agent.cleanup()


Figures = tuple[int, int, float, float]  # answered, failed, longest gap, longest call (s)


async def run(mode: str, args: argparse.Namespace) -> dict[str, Figures]:
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        async with running_cluster(tmp) as cluster:
            try:
                return await _run(cluster, tmp, mode, args)
            finally:
                for agent in cluster.agents.values():
                    agent.cleanup()


async def _run(cluster: Cluster, tmp: Path, mode: str, args: argparse.Namespace
               ) -> dict[str, Figures]:
    old = [f"old-{i}" for i in range(args.pods)]
    for name in old:
        await cluster.add_pod(name, new_agent(tmp, name))
    app = await cluster.start(door=DoorSettings(port=0, access_log=args.access_log))
    models = [f"m{i}" for i in range(args.pods)]
    for name in models:
        await cluster.apply(claim_obj(name, {"--sim-startup-seconds": str(args.start_s),
                                             "--sim-request-seconds": str(args.call_s)}, "2Gi"))
    for name in models:
        await cluster.until(f"{name} Active", lambda n=name: cluster.phase(n) == "Active", 120)
    assert app.door is not None
    stop = asyncio.Event()
    answers: dict[str, list[tuple[float, int, float]]] = {m: [] for m in models}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = [asyncio.ensure_future(caller(http, app.door.port, f"{m}-model", stop,
                                              answers[m]))
                 for m in models for _ in range(args.callers)]
        await asyncio.sleep(2.0)
        started = time.monotonic()
        for i, name in enumerate(old):
            await replace_pod(cluster, tmp, name, f"new-{i}", mode)
        for name in models:
            await cluster.until(f"{name} Active again", lambda n=name: cluster.phase(n)
                                == "Active" and all(
                                    i["pod"].startswith("new-") for i in
                                    ((cluster.claim(n) or {}).get("status") or {})
                                    .get("instances") or ()), 180)
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*tasks)
    print(f"  {mode}: rollout of {args.pods} Pods took {time.monotonic() - started:.1f} s",
          flush=True)
    out = {}
    for m, got in answers.items():
        good = sorted(t for t, status, _ in got if status == 200)
        gap = max((b - a for a, b in zip(good, good[1:], strict=False)), default=0.0)
        out[m] = (len(good), sum(1 for _, status, _ in got if status != 200), gap,
                  max((took for _, _, took in got), default=0.0))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pods", type=int, default=3)
    p.add_argument("--start-s", type=float, default=1.5, help="an engine's start time")
    p.add_argument("--call-s", type=float, default=0.1, help="one call's time")
    p.add_argument("--callers", type=int, default=2, help="callers per model, one call after "
                   "another each")
    p.add_argument("--access-log", default="off", help="the door's access log (default off)")
    args = p.parse_args(argv)
    results: dict[str, Any] = {}
    for mode in MODES:
        results[mode] = asyncio.run(run(mode, args))
    print("| run | model | answered | failed | longest gap between answers (s) | longest call (s) |")
    print("|---|---|---|---|---|---|")
    for mode, per in results.items():
        for model, (good, failed, gap, took) in sorted(per.items()):
            print(f"| {mode} | {model} | {good} | {failed} | {gap:.2f} | {took:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
