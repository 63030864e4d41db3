"""Side-by-side plumbing: one engine reached directly and through proxies, in one run.

``bench.bench_door`` (the door against direct and a byte relay) and ``bench.bench_envoy`` (the
door against Envoy) measure the same way: the agent in the README's embedded mode with its door
(``start_door``), closed-loop aiohttp clients over keep-alive connections (``load``), and slices
of every target interleaved in a palindrome so that drift in a shared machine's load hits each
alike (``interleave``); a target's slices are pooled into one ``Slice`` per row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.common import Session, log, percentile
from tests.harness import AgentProcess
from tests.reconciler_fakes import claim_yaml

AGENT_ARGS = ["--simulate-gpus", "1x80GiB", "--scrape-interval", "2", "--kv-hold-interval", "1",
              "--gpu-sample-interval", "1"]
BASE = {"--sim-startup-seconds": "0.2", "--sim-memory-bytes": str(1 << 30),
        "--max-model-len": "4096"}
ROOT = Path(__file__).resolve().parent.parent


def claim(name: str, args: dict[str, str]) -> str:
    return claim_yaml(name, footprint="4Gi", args={**BASE, **args})


@dataclass
class Slice:
    latency: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)  # the door's own time (its access log)
    seconds: float = 0.0
    errors: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    cpu_wall: float = 0.0  # the seconds over which ``cpu`` was taken (the whole slice)
    served: int = 0  # every answer in those seconds, measured or not: what ``cpu`` paid for

    def add(self, other: Slice) -> None:
        self.latency += other.latency
        self.ttft += other.ttft
        self.own += other.own
        self.seconds += other.seconds
        self.errors += other.errors
        self.cpu_wall += other.cpu_wall
        self.served += other.served
        for k, v in other.cpu.items():
            self.cpu[k] = self.cpu.get(k, 0.0) + v

    @property
    def rate(self) -> float:
        return len(self.latency) / self.seconds if self.seconds else 0.0

    def ms(self, p: float, ttft: bool = False) -> float:
        return percentile(self.ttft if ttft else self.latency, p) * 1000

    def cpu_ms(self, who: str) -> float:
        return self.cpu.get(who, 0.0) * 1000 / max(1, self.served)


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def load(http: aiohttp.ClientSession, url: str, c: int, seconds: float, stream: bool,
               tokens: int, procs: dict[str, psutil.Process], spread: float = 0.0) -> Slice:
    """``c`` closed-loop clients for ``seconds``; client i starts ``i * spread / c`` late (0: all
    at once, a burst), and only requests sent after the last one started are measured. ``url``
    ends in ``#model``; a ``/chat/completions`` URL gets messages, any other a prompt."""
    target, model = url.rsplit("#", 1)
    text: dict[str, Any] = {"messages": [{"role": "user", "content": "the warm pool"}]} \
        if target.endswith("/chat/completions") else {"prompt": "the warm pool"}
    body = json.dumps({"model": model, **text, "max_tokens": tokens, "stream": stream}).encode()
    out = Slice()
    headers = {"Content-Type": "application/json"}
    begin = time.perf_counter()
    measured_from = begin + spread
    stop = measured_from + seconds

    async def worker(i: int) -> None:
        await asyncio.sleep(i * spread / c)
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            first = None
            async with http.post(target, data=body, headers=headers) as resp:
                if stream:
                    async for _ in resp.content.iter_any():
                        if first is None:
                            first = time.perf_counter()
                else:
                    await resp.read()
                ok = resp.status == 200
            t1 = time.perf_counter()
            out.served += 1
            if t0 < measured_from:
                continue
            if not ok:
                out.errors += 1
                continue
            out.latency.append(t1 - t0)
            if first is not None:
                out.ttft.append(first - t0)

    before = {k: _cpu(p) for k, p in procs.items()}
    own = os.times()
    await asyncio.gather(*(worker(i) for i in range(c)))
    out.seconds = stop - measured_from
    out.cpu_wall = time.perf_counter() - begin
    after = os.times()
    out.cpu = {k: _cpu(p) - before[k] for k, p in procs.items()}
    out.cpu["loadgen"] = (after.user + after.system) - (own.user + own.system)
    return out


def engine_argv(port: int, args: dict[str, str]) -> list[str]:
    flat = [x for k, v in {**BASE, **args}.items() for x in (k, v)]
    return [sys.executable, "-m", "engines.sim", "serve", "bench/w", "--served-model-name", "w",
            "--host", "127.0.0.1", "--port", str(port), "--enable-sleep-mode",
            "--disable-uvicorn-access-log", *flat]


async def until(http: aiohttp.ClientSession, claims: str, model: str, state: str,
                timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        async with http.get(claims + "/v1/routes") as resp:
            routes = {r["model"]: r for r in (await resp.json())["routes"]}
        route: dict[str, Any] | None = routes.get(model)
        if route is not None and route["state"] == state:
            return route
        if time.monotonic() > deadline:
            raise AssertionError(f"{model} not {state}: {route}")
        await asyncio.sleep(0.05)


@dataclass
class Door:
    """The agent in the embedded mode with its door, every claimed engine active."""
    agent: AgentProcess
    url: str  # the door
    claims: str  # the reconciler's API
    access: Path  # the door's access log
    routes: dict[str, dict[str, Any]]  # model -> its route (the engine's port)
    procs: dict[str, psutil.Process]  # "agent+door" and "engine <model>"


async def start_door(s: Session, http: aiohttp.ClientSession,
                     engines: dict[str, dict[str, str]]) -> Door:
    """``runtime-agent serve --claims DIR --door-port P`` with one claim per engine (its flags),
    once every route is active."""
    claims = s.tmp / "claims"
    claims.mkdir()
    for name, flags in engines.items():
        (claims / f"{name}.yaml").write_text(claim(name, flags))
    access = s.tmp / "access.log"
    agent = s.agent(engine_host=None, extra_args=[
        *AGENT_ARGS, "--claims", str(claims), "--door-access-log", str(access)])
    assert agent.proc is not None
    door_port, claims_port = agent.ports["--door-port"], agent.ports["--claims-port"]
    claims_url = f"http://127.0.0.1:{claims_port}"
    routes = {m: await until(http, claims_url, m, "active") for m in engines}
    procs = {"agent+door": psutil.Process(agent.proc.pid)}
    for m in agent.client.snapshot()["models"]:
        procs[f"engine {m['model_name']}"] = psutil.Process(m["pid"])
    door = Door(agent, f"http://127.0.0.1:{door_port}", claims_url, access, routes, procs)
    log(f"agent pid {agent.proc.pid}, door {door.url}, engines "
        f"{ {m: r['port'] for m, r in routes.items()} }")
    return door


class AccessTail:
    """The door's own time per request, from the lines its access log gained: the request's
    time in the door less the engine's (``upstream_ms``) and any hold."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    async def take(self) -> list[float]:
        await asyncio.sleep(0.3)  # the door writes its lines within 0.2 s
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        self.offset += len(data)
        out = []
        for line in data.decode().splitlines():
            doc = json.loads(line)
            if doc.get("upstream_ms") is not None and doc["status"] == 200:
                out.append((doc["duration_ms"] - doc["upstream_ms"] - (doc["held_ms"] or 0.0))
                           / 1000)
        return out


Table = dict[tuple[str, int, str, str], Slice]  # (engine, c, mode, target): pooled slices
Run = tuple[str, int, bool, bool]  # engine, concurrency, streamed, clients spread out


async def interleave(http: aiohttp.ClientSession, args: argparse.Namespace, runs: list[Run],
                     urls: Callable[[str], dict[str, str]], order: tuple[str, ...],
                     procs: dict[str, psutil.Process], tail: AccessTail | None) -> Table:
    """Each run against every target of ``urls(engine)`` (one is ``direct``): a warm-up slice
    each, then ``order`` (a palindrome, so drift hits every target alike) ``args.rounds`` times,
    ``args.seconds`` a slice; a ``door`` slice gets the door's own times from ``tail``."""
    table: Table = {}
    for model, c, stream, spread_out in runs:
        targets = urls(model)
        warm = {t: await load(http, u, c, 0.5, stream, args.max_tokens, procs)
                for t, u in targets.items()}  # warms the connections, and times one request
        if tail is not None:
            await tail.take()
        spread = warm["direct"].ms(50) / 1000 if spread_out else 0.0
        mode = ("stream" if stream else "json") + ("" if spread_out else " burst")
        for target in order * args.rounds:
            got = await load(http, targets[target], c, args.seconds, stream, args.max_tokens,
                             procs, spread)
            if target == "door" and tail is not None:
                got.own = await tail.take()
            table.setdefault((model, c, mode, target), Slice()).add(got)
        log(f"{model} c={c} {mode}: " + ", ".join(
            f"{t} p50 {table[(model, c, mode, t)].ms(50):.2f} ms "
            f"{table[(model, c, mode, t)].rate:.0f}/s" for t in targets))
    return table
