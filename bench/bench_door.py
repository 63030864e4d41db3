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
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.common import Result, log, percentile, run_main, session
from bench.sidebyside import (ROOT, AccessTail, Run, Table, engine_argv, interleave, start_door,
                              until)
from tests.harness import AgentProcess, engine_port, free_port, port_is_open, wait_until

CONCURRENCY = (1, 16, 64)
GOAL_ADDED_P50_MS, GOAL_ADDED_P99_MS, GOAL_THROUGHPUT, GOAL_WAKE_MS = 0.5, 2.0, 0.5, 50.0

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
