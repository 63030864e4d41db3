"""Run the six benchmarks in sequence and print a markdown table (figure, goal, measured, pass).

    python -m bench.run_all [--repeat 3] [--only crash,readiness,...] [--json results.json]
                            [--write bench/RESULTS.md]

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


def run_one(key: str) -> Result:
    try:
        return BENCHES[key]()
    except Exception as exc:  # noqa: BLE001 - reported as a failed figure; the rest still run
        traceback.print_exc()
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        errors = [ln for ln in lines[1:] if "Error:" in ln or "Exception:" in ln]
        short = " / ".join(lines[:1] + errors[-1:])
        return Result(figure=key, goal="(see the benchmark)",
                      measured=f"error: {type(exc).__name__}: {short[:300]}", passed=False)


def median_run(runs: list[Result]) -> Result:
    """The run whose headline is the median (the lower one of an even count)."""
    scored = [r for r in runs if r.headline is not None]
    if not scored:
        return runs[0]
    scored.sort(key=lambda r: r.headline[1] if r.headline else 0.0)
    return scored[(len(scored) - 1) // 2]


def spread(runs: list[Result]) -> str:
    values = [r.headline[1] for r in runs if r.headline is not None]
    if not values or runs[0].headline is None:
        return "-"
    what = runs[0].headline[0]
    return f"{what} {min(values):.3g}-{max(values):.3g}" if len(values) > 1 else f"{what} {values[0]:.3g}"


def table(results: dict[str, list[Result]], header: str, loads: list[float], wall_s: float,
          foreign: list[str]) -> str:
    repeats = max(len(runs) for runs in results.values())
    out = [header, "",
           f"Each figure ran {repeats} time(s) in turn; *measured* is the run with the median "
           "headline figure, *spread* its range over the runs, *passed* how many runs met the goal.",
           "", "| figure | goal | measured (median run) | spread | passed |", "|---|---|---|---|---|"]
    for runs in results.values():
        mid = median_run(runs)
        measured = mid.measured.replace("|", "/").replace("\n", " ")
        passed = sum(r.passed for r in runs)
        out.append(f"| {mid.figure} | {mid.goal} | {measured} | {spread(runs)} | "
                   f"{passed}/{len(runs)} {'PASS' if passed == len(runs) else 'FAIL'} |")
    out += ["", f"1-min load average over the run (2 cores): min {min(loads):.1f}, max "
            f"{max(loads):.1f}; other work found on the machine before each figure "
            f"(pytest/agents/engines): {', '.join(sorted(set(foreign)))}; wall time {wall_s:.0f} s."]
    return "\n".join(out)


BEGIN, END = "<!-- run_all: begin -->", "<!-- run_all: end -->"


def write_section(path: str, text: str) -> None:
    """Replace the generated section of ``path`` (between the markers) with ``text``."""
    with open(path) as fh:
        doc = fh.read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to replace")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as fh:
        fh.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset")
    p.add_argument("--repeat", type=int, default=1, help="run every figure this many times")
    p.add_argument("--json", help="also write the results (with details) to this file")
    p.add_argument("--write", metavar="RESULTS_MD",
                   help="replace the generated section of this file (bench/RESULTS.md) "
                        "with the table")
    args = p.parse_args()
    keys = args.only.split(",")
    results: dict[str, list[Result]] = {key: [] for key in keys}
    loads: list[float] = [os.getloadavg()[0]]
    foreign: list[str] = []
    started = time.time()
    t0 = time.monotonic()
    tree = tree_state()
    for round_no in range(args.repeat):
        for key in keys:
            log(f"running {key} ({round_no + 1}/{args.repeat})")
            foreign.append(foreign_work())
            result = run_one(key)
            results[key].append(result)
            loads.append(os.getloadavg()[0])
            print(result.report() + "\n", flush=True)
    command = "python -m bench.run_all" + (f" --repeat {args.repeat}" if args.repeat > 1 else "") \
        + (f" --only {args.only}" if args.only != ",".join(BENCHES) else "")
    header = (f"### Run of {time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(started))}"
              f": `{command}`; agent at {tree}; {machine()}")
    text = table(results, header, loads, time.monotonic() - t0, foreign)
    print(text)
    if args.write:
        write_section(args.write, text)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({key: [{"figure": r.figure, "goal": r.goal, "measured": r.measured,
                              "passed": r.passed, "headline": r.headline, "details": r.details,
                              "lines": r.lines} for r in runs] for key, runs in results.items()},
                      fh, indent=2, default=str)
    return 0 if all(r.passed for runs in results.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
