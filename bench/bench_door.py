"""Figure 9: the front door against calling the engine directly, side by side in one run.

One agent in the README's embedded mode (``runtime-agent serve --claims DIR --door-port P``,
through ``tests.harness.AgentProcess``; engines on loopback, production scrape and KV-hold
intervals, the door's access log on, as by default) serving simulated vLLM engines:

* ``m``: the measured engine, simulating a small model on a GPU: ``--engine-request-seconds``
  before the first token (prefill, default 20 ms) and ``--engine-token-seconds`` per further
  token (default 5 ms), ``--max-tokens`` 16 tokens per answer (~95 ms a request);
* ``f``: the same with no simulated compute, so that the door's own CPU cost shows fully (a
  stress row, not judged by the goals);
* ``s``: ``--wake-seconds`` (1 s) to wake, for the time to first token of a sleeping model.

The load generator is this process: asyncio + aiohttp, ``c`` closed-loop clients each sending
``POST /v1/completions`` (``max_tokens`` 16, streamed or not) one after the other over keep-alive
connections, for ``--seconds`` per slice. Independent clients do not start in step: client i
starts ``i / c`` of one request's time late (measured on the engine's port), and only requests
sent after the last client started count. With a simulated engine every request takes the same
time, so clients started together stay in step and every answer of a round arrives at once: the
``burst`` rows (c = 16, all started together) show what such a burst costs through the door,
which handles its answers one after the other. Each concurrency and mode runs ``--rounds`` times
six slices: direct (the engine's port), door, relay, relay, door, direct, so that drift in the
machine's load hits every target alike; the samples of a target's slices are pooled. The third
target, ``relay``, is the cheapest proxy asyncio can be (a byte pump per connection, no HTTP, in
its own process): what any extra hop written in Python costs on this machine, for scale.
Latency is send to last byte; time to first token (streams) is send to the first body chunk.
Added latency is the difference of two targets' percentiles (requests cannot be paired). The
door's own time is per request, from its access log: its time in the door less the engine's
(``upstream_ms``): what the door spends inside, without the scheduling waits of a process on a
loaded machine before it reads a request and after it writes the answer. CPU
seconds per request are measured for the agent process (where the door runs, less what it
spends while the direct slices run), the relay, the engine and the load generator itself.

Sleeping model: ``--wake-rounds`` times, ``s`` is put to sleep through the agent's API and the
claim shows Sleeping; then a streamed request goes to the door and its time to first token is
taken. The engine's own wake time is measured on a second engine process started by this bench
with the same flags (no agent): ``POST /sleep``, then ``POST /wake_up`` timed, then a streamed
request (its time to first token awake). The figure: the door's TTFT for the sleeping model
minus the engine's own wake time.

Goals (issue 15): at concurrency 16, added latency p50 <= 0.5 ms and p99 <= 2 ms; throughput
through the door at least half of direct; TTFT of a sleeping model within 50 ms of the engine's
own wake time.

    python -m bench.bench_door [--seconds 4] [--wake-rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.common import Result, Session, log, percentile, run_main, session
from tests.harness import AgentProcess, engine_port, free_port, port_is_open, wait_until
from tests.reconciler_fakes import claim_yaml

CONCURRENCY = (1, 16, 64)
GOAL_ADDED_P50_MS, GOAL_ADDED_P99_MS, GOAL_THROUGHPUT, GOAL_WAKE_MS = 0.5, 2.0, 0.5, 50.0
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


RELAY = """
import asyncio, sys
async def pump(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
async def serve(reader, writer):
    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", int(sys.argv[2]))
    await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer),
                         return_exceptions=True)
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()
asyncio.run(main())
"""


def relay(listen: int, engine: int) -> subprocess.Popen[bytes]:
    """The cheapest proxy Python's asyncio can be: a byte pump per connection, no HTTP."""
    proc = subprocess.Popen([sys.executable, "-c", RELAY, str(listen), str(engine)],
                            start_new_session=True)
    assert wait_until(lambda: port_is_open(listen), 10), "the relay did not start"
    return proc


def engine_argv(port: int, args: dict[str, str]) -> list[str]:
    flat = [x for k, v in {**BASE, **args}.items() for x in (k, v)]
    return [sys.executable, "-m", "engines.sim", "serve", "bench/w", "--served-model-name", "w",
            "--host", "127.0.0.1", "--port", str(port), "--enable-sleep-mode",
            "--disable-uvicorn-access-log", *flat]


async def direct_wake(http: aiohttp.ClientSession, args: dict[str, str], rounds: int,
                      tmp: Path) -> tuple[list[float], list[float]]:
    """The engine's own wake time and its TTFT awake, on an engine of our own (no agent)."""
    port = engine_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with open(tmp / "wake-engine.log", "wb") as out:
        proc = subprocess.Popen(engine_argv(port, args), cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_until(lambda: port_is_open(port), 30), "the wake engine did not start"
        base = f"http://127.0.0.1:{port}"
        wakes, ttfts = [], []
        for _ in range(rounds):
            async with http.post(base + "/sleep?level=1") as resp:
                assert resp.status == 200
            t0 = time.perf_counter()
            async with http.post(base + "/wake_up") as resp:
                assert resp.status == 200
            wakes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            async with http.post(base + "/v1/completions", json={
                    "model": "w", "prompt": "hi", "max_tokens": 2, "stream": True}) as resp:
                await resp.content.readany()
                ttfts.append(time.perf_counter() - t0)
                await resp.read()
        return wakes, ttfts
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


async def door_wake(http: aiohttp.ClientSession, agent: AgentProcess, door: str, claims: str,
                    rounds: int) -> list[float]:
    """TTFT through the door for model ``s`` asleep (put to sleep through the agent)."""
    out = []
    for _ in range(rounds):
        await asyncio.to_thread(agent.client.sleep, "s")
        await until(http, claims, "s", "sleeping")
        t0 = time.perf_counter()
        async with http.post(door + "/v1/completions", json={
                "model": "s", "prompt": "hi", "max_tokens": 2, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            await resp.content.readany()
            out.append(time.perf_counter() - t0)
            await resp.read()
        await until(http, claims, "s", "active")
    return out


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
    door_port, claims_port = free_port(), free_port()
    access = s.tmp / "access.log"
    agent = s.agent(engine_host=None, extra_args=[
        *AGENT_ARGS, "--claims", str(claims), "--claims-port", str(claims_port),
        "--door-port", str(door_port), "--door-access-log", str(access)])
    assert agent.proc is not None
    claims_url = f"http://127.0.0.1:{claims_port}"
    routes = {m: await until(http, claims_url, m, "active") for m in engines}
    procs = {"agent+door": psutil.Process(agent.proc.pid)}
    for m in agent.client.snapshot()["models"]:
        procs[f"engine {m['model_name']}"] = psutil.Process(m["pid"])
    door = Door(agent, f"http://127.0.0.1:{door_port}", claims_url, access, routes, procs)
    log(f"agent pid {agent.proc.pid}, door {door.url}, engines "
        f"{ {m: r['port'] for m, r in routes.items()} }")
    return door


async def measure(args: argparse.Namespace) -> Result:
    realistic = {"--sim-request-seconds": str(args.engine_request_seconds),
                 "--sim-token-seconds": str(args.engine_token_seconds)}
    sleeper = {**realistic, "--sim-wake-seconds": str(args.wake_seconds)}
    with session("door") as s:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            door = await start_door(s, http, {"m": realistic, "f": {}, "s": sleeper})
            routes, procs = door.routes, door.procs
            relay_ports = {m: free_port() for m in ("m", "f")}
            relays = {m: relay(port, routes[m]["port"]) for m, port in relay_ports.items()}
            try:
                for m, proc in relays.items():
                    procs[f"relay {m}"] = psutil.Process(proc.pid)
                table = await side_by_side(http, args, door.url, routes, procs, relay_ports,
                                           AccessTail(door.access))
            finally:
                for proc in relays.values():
                    os.killpg(proc.pid, 9)
                    proc.wait()
            log("sleeping-model wake rounds")
            wake_direct, ttft_awake = await direct_wake(http, sleeper, args.wake_rounds, s.tmp)
            ttft_sleeping = await door_wake(http, door.agent, door.url, door.claims,
                                            args.wake_rounds)
        return report(args, table, wake_direct, ttft_awake, ttft_sleeping)


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


async def side_by_side(http: aiohttp.ClientSession, args: argparse.Namespace, door: str,
                       routes: dict[str, dict[str, Any]], procs: dict[str, psutil.Process],
                       relays: dict[str, int], tail: AccessTail) -> Table:
    runs: list[Run] = [("m", c, stream, True) for stream in (False, True) for c in CONCURRENCY]
    runs += [("m", 16, stream, False) for stream in (False, True)]  # bursts of 16
    runs += [("f", c, False, True) for c in CONCURRENCY]
    if args.only:
        runs = [r for r in runs if f"{r[0]}:{r[1]}" in args.only.split(",")]

    def urls(model: str) -> dict[str, str]:
        return {"direct": f"http://127.0.0.1:{routes[model]['port']}/v1/completions#{model}",
                "relay": f"http://127.0.0.1:{relays[model]}/v1/completions#{model}",
                "door": f"{door}/v1/completions#{model}"}

    return await interleave(http, args, runs, urls, ("direct", "door", "relay", "relay", "door",
                                                     "direct"), procs, tail)


def report(args: argparse.Namespace, table: Table,
           wake_direct: list[float], ttft_awake: list[float],
           ttft_sleeping: list[float]) -> Result:
    lines = [f"engine m: {args.engine_request_seconds * 1000:g} ms to the first token, "
             f"{args.engine_token_seconds * 1000:g} ms per further token, {args.max_tokens} "
             f"tokens; engine f: no simulated compute; {args.seconds:g} s x {2 * args.rounds} slices "
             "per target",
             "", "| engine | c | mode | direct p50 / p99 ms | relay: added p50 / p99 ms | door: "
             "added p50 / p99 ms | door's own p50 / p99 ms | req/s direct, relay, door | door "
             "share | CPU ms/req: door, relay, engine, loadgen |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    passed, details = True, {}
    for (model, c, kind, target), got in sorted(table.items()):
        if target != "door":
            continue
        d, r = table[(model, c, kind, "direct")], table[(model, c, kind, "relay")]
        stream = kind.startswith("stream")
        for ttft in ((False, True) if stream else (False,)):
            added50, added99 = got.ms(50, ttft) - d.ms(50, ttft), got.ms(99, ttft) - d.ms(99, ttft)
            share = got.rate / d.rate if d.rate else 0.0
            mode = kind.replace("stream", "stream TTFT") if ttft else kind
            door_cpu = got.cpu_ms("agent+door") - d.cpu_ms("agent+door")  # less its idle work
            own = "-" if ttft or not got.own else \
                f"{percentile(got.own, 50) * 1000:.2f} / {percentile(got.own, 99) * 1000:.2f}"
            lines.append(
                f"| {model} | {c} | {mode} | {d.ms(50, ttft):.2f} / {d.ms(99, ttft):.2f} | "
                f"{r.ms(50, ttft) - d.ms(50, ttft):+.2f} / {r.ms(99, ttft) - d.ms(99, ttft):+.2f}"
                f" | {added50:+.2f} / {added99:+.2f} | {own} | {d.rate:.0f}, {r.rate:.0f}, "
                f"{got.rate:.0f} | {share:.2f} | {door_cpu:.2f}, {r.cpu_ms('relay ' + model):.2f}"
                f", {got.cpu_ms('engine ' + model):.2f}, {got.cpu_ms('loadgen'):.2f} |")
            details[f"{model} c{c} {mode}"] = {"added_p50_ms": added50, "added_p99_ms": added99,
                                               "share": share, "errors": got.errors + d.errors}
            if model == "m" and c == 16 and "burst" not in mode and (
                    added50 > GOAL_ADDED_P50_MS or added99 > GOAL_ADDED_P99_MS):
                passed = False
            if model == "m" and not ttft and share < GOAL_THROUGHPUT:
                passed = False
            if got.errors or d.errors or r.errors:
                passed = False
    wake_ms = percentile(wake_direct, 50) * 1000
    over = [(t - w) * 1000 for t, w in zip(sorted(ttft_sleeping), sorted(wake_direct),
                                           strict=True)]
    over50 = percentile(ttft_sleeping, 50) * 1000 - wake_ms
    over_max = max(ttft_sleeping) * 1000 - wake_ms
    awake = percentile(ttft_awake, 50) * 1000
    lines += ["", f"sleeping model ({args.wake_rounds} rounds): engine's own wake p50 "
              f"{wake_ms:.1f} ms (its TTFT awake p50 {awake:.1f} ms); door TTFT asleep p50 "
              f"{percentile(ttft_sleeping, 50) * 1000:.1f} ms, max "
              f"{max(ttft_sleeping) * 1000:.1f} ms; over the wake: p50 {over50:.1f} ms, max "
              f"{over_max:.1f} ms (ranked pairs: {', '.join(f'{o:.0f}' for o in over)})"]
    details["wake"] = {"over_p50_ms": over50, "over_max_ms": over_max, "wake_p50_ms": wake_ms}
    passed = passed and over50 <= GOAL_WAKE_MS
    shares = [v["share"] for k, v in details.items() if k.startswith("m ") and "TTFT" not in k]
    c16 = details.get("m c16 json", {"added_p50_ms": float("nan"), "added_p99_ms": float("nan")})
    measured = (f"c=16 json: added p50 {c16['added_p50_ms']:+.2f} ms, p99 "
                f"{c16['added_p99_ms']:+.2f} ms; door throughput share min "
                f"{min(shares, default=float('nan')):.2f}; sleeping TTFT over the wake p50 "
                f"{over50:.1f} ms")
    return Result("9. front door vs direct", "c=16: added p50 <= 0.5 ms, p99 <= 2 ms; door "
                  "throughput >= 0.5 x direct; sleeping TTFT <= wake + 50 ms", measured, passed,
                  details, lines)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0, help="per slice")
    p.add_argument("--rounds", type=int, default=2,
                   help="direct, door, relay, relay, door, direct slices this many times per run")
    p.add_argument("--engine-request-seconds", type=float, default=0.02)
    p.add_argument("--engine-token-seconds", type=float, default=0.005)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--only", default="", metavar="ENGINE:C,...",
                   help="only these runs, e.g. m:16 (the goals' row) to measure it longer")
    p.add_argument("--wake-seconds", type=float, default=1.0)
    p.add_argument("--wake-rounds", type=int, default=10)
    args = p.parse_args()
    return run_main(lambda: asyncio.run(measure(args)))


if __name__ == "__main__":
    sys.exit(main())
