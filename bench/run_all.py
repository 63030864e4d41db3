"""Run the six benchmarks in sequence and print a markdown table (figure, goal, measured, pass).

    python -m bench.run_all [--only crash,readiness,...] [--json results.json]

Each benchmark starts and cleans up its own agent and engines; one that errors is reported as
FAIL with the error and the rest still run. Exit status 0 only when every figure passes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import psutil

from bench import (
    bench_crash,
    bench_isolation,
    bench_kv,
    bench_readiness,
    bench_readoption,
    bench_scale,
)
from bench.common import Result, log

BENCHES: dict[str, Callable[[], Result]] = {
    "crash": bench_crash.run,
    "readiness": bench_readiness.run,
    "isolation": bench_isolation.run,
    "scale": bench_scale.run,
    "readoption": bench_readoption.run,
    "kv": bench_kv.run,
}


def machine() -> str:
    mem = psutil.virtual_memory().total / 1024**3
    return (f"{psutil.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}, simulated engines, no GPU")


def tree_state() -> str:
    """The agent code measured: HEAD and how many files outside bench/ differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--short"], capture_output=True, text=True,
                                check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    dirty = [line for line in status if not line[3:].startswith("bench/")]
    return f"commit {head}" + (f" + {len(dirty)} uncommitted paths outside bench/" if dirty else "")


def foreign_work() -> str:
    """Other test runs on this machine right now (the machine is shared): pytest, agents, engines.
    Called between benchmarks, when this suite has none of its own running."""
    counts = {"pytest": 0, "agents": 0, "engines": 0}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "runtime_agent.cli serve" in cmd:
            counts["agents"] += 1
        elif "engines.sim serve" in cmd:
            counts["engines"] += 1
        elif "pytest" in cmd and "timeout" not in cmd.split()[:1]:
            counts["pytest"] += 1
    return "/".join(str(v) for v in counts.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset")
    p.add_argument("--json", help="also write the results (with details) to this file")
    args = p.parse_args()
    results: list[tuple[Result, float]] = []
    loads: list[tuple[float, float]] = []
    foreign: list[str] = []
    started = time.time()
    tree = tree_state()
    for key in args.only.split(","):
        log(f"running {key}")
        t0 = time.monotonic()
        load0 = os.getloadavg()[0]
        foreign.append(foreign_work())
        try:
            result = BENCHES[key]()
        except Exception as exc:
            traceback.print_exc()
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            errors = [ln for ln in lines[1:] if "Error:" in ln or "Exception:" in ln]
            short = " / ".join(lines[:1] + errors[-1:])
            result = Result(figure=key, goal="(see the benchmark)",
                            measured=f"error: {type(exc).__name__}: {short[:300]}", passed=False)
        results.append((result, time.monotonic() - t0))
        loads.append((load0, os.getloadavg()[0]))
        print(result.report() + "\n", flush=True)
    print(f"## Results ({time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(started))}; {machine()}; "
          f"agent at {tree}; `python -m bench.run_all`)\n")
    print("| figure | goal | measured | pass |")
    print("|---|---|---|---|")
    for result, _ in results:
        measured = result.measured.replace("|", "/").replace("\n", " ")
        print(f"| {result.figure} | {result.goal} | {measured} | "
              f"{'PASS' if result.passed else 'FAIL'} |")
    print("\n1-min load average before -> after each figure (2 cores), and other work found on "
          "the machine just before it (pytest/agents/engines not started by this suite): " +
          "; ".join(f"{r.figure.split()[0]} {a:.1f} -> {b:.1f} [{f}]"
                    for (r, _), (a, b), f in zip(results, loads, foreign)))
    total = sum(s for _, s in results)
    print(f"\nwall time: {total:.0f} s ({', '.join(f'{r.figure.split()[0]} {s:.0f} s' for r, s in results)})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{"figure": r.figure, "goal": r.goal, "measured": r.measured,
                        "passed": r.passed, "seconds": s, "loadavg": ld, "details": r.details, "lines": r.lines}
                       for (r, s), ld in zip(results, loads)], fh, indent=2, default=str)
    return 0 if all(r.passed for r, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
