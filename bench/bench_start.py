"""Figure 15: the agent's start-up, memory and re-adoption against the interpreter's floor.

The floor is a bare interpreter that imports what the agent cannot do without (aiohttp,
pydantic, psutil, prometheus-client) and answers one HTTP request (``FLOOR``). In one run:

* process start to first answer: from just before ``Popen`` until a GET is answered (the floor
  on ``/``, a plain ``runtime-agent serve --engines sim --gpu sim`` on ``/healthz``), polled
  every 5 ms the same way for both; ``--repeats`` each, interleaved; the ratio is the median
  of each agent start over the floor's beside it (one moment of a shared machine's load), and
  the CPU each had spent by its answer is shown beside (less sensitive to that load);
  ``--before DIR`` measures another tree's agent (main's) in the same rounds;
* RSS: each process's resident memory once it answered and settled (the agent with no engine),
  and the agent's with ``--scale`` engines active (``bench.bench_scale``'s figure);
* re-adoption: 32 simulated engines, the agent SIGKILLed, a new agent on the same state
  directory: process start to every engine active, ready and adopted, none restarted
  (``bench.bench_readoption``, whose figure this is), ``--adopt-repeats`` times, each between
  two floor starts: the ratio is the median of each over the mean of the floor's beside it;

with each figure's ratio to the floor. Our packages are byte-compiled first, as an installed
agent is (``pip install`` compiles them): the machine's ``PYTHONDONTWRITEBYTECODE=1`` would
otherwise have the agent compile every module of its own at each start, and not the floor's.

    python -m bench.bench_start [--repeats 7] [--engines 32] [--scale 64] [--before DIR]
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import http.client
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from bench import bench_readoption, bench_scale
from bench.bench_readoption import log_marks
from bench.common import Result, log, run_main, session
from tests.harness import free_port

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime_agent", "engines", "registry", "reconciler", "contract", "guard")
GOALS = {"start": 1.3, "readoption": 1.5}  # times the floor's process start to first answer
RSS_GOAL_MIB = 10.0  # over the floor's
POLL_S = 0.005  # between attempts to connect: finer steals a core from the start measured
SETTLE_S = 1.5  # after the first answer, before RSS is read (the agent's first GPU samples)

FLOOR = """\
import asyncio, sys
import aiohttp, psutil, prometheus_client, pydantic
from aiohttp import web

async def hello(request):
    return web.Response(text="ok")

async def main():
    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", int(sys.argv[1])).start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _answered(port: int, path: str) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def start_to_answer(argv: Sequence[str], port: int, path: str, env: dict[str, str],
                    log_path: Path | None = None, timeout_s: float = 30.0
                    ) -> tuple[float, float, float, int]:
    """(seconds from just before Popen to the first 200 on ``path``, the CPU seconds the
    process had spent by then, wall clock at Popen, the settled RSS in bytes); the process is
    stopped before this returns."""
    out = log_path.open("wb") if log_path is not None else subprocess.DEVNULL
    wall0, t0 = time.time(), time.perf_counter()
    proc = subprocess.Popen(argv, cwd=env.get("PYTHONPATH", ROOT), env=env, stdout=out,
                            stderr=out, start_new_session=True)
    if not isinstance(out, int):
        out.close()
    try:
        while not _answered(port, path):
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[:4]} exited with {proc.returncode} before answering")
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"{argv[:4]} did not answer within {timeout_s} s")
            time.sleep(POLL_S)
        took = time.perf_counter() - t0
        watched = psutil.Process(proc.pid)
        cpu = watched.cpu_times()
        time.sleep(SETTLE_S)
        return took, cpu.user + cpu.system, wall0, watched.memory_info().rss
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(5)


def agent_argv(port: int, state_dir: Path) -> list[str]:
    """A plain serve: simulated engines and GPU, every other flag its default."""
    return [sys.executable, "-m", "runtime_agent.cli", "serve", "--engines", "sim", "--gpu",
            "sim", "--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state_dir),
            "--log-format", "text"]


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f} MiB"


def run(repeats: int = 7, engines: int = 32, before: Path | None = None,
        scale: int = 64, adopt_repeats: int = 3) -> Result:
    for tree in (ROOT, before) if before is not None else (ROOT,):
        for package in PACKAGES:
            compileall.compile_dir(str(tree / package), quiet=1)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    older: list[float] = []  # ``before``'s agent: process start to first answer
    load0 = os.getloadavg()
    floor_s: list[float] = []
    floor_cpu: list[float] = []
    floor_rss: list[int] = []
    agent_s: list[float] = []
    agent_cpu: list[float] = []
    agent_rss: list[int] = []
    marks: list[dict[str, float]] = []
    with session("start") as s:
        for i in range(repeats):
            order = ("floor", "agent", "before") if i % 2 == 0 else ("before", "agent", "floor")
            for who in order:
                port = free_port()
                if who == "before":
                    if before is not None:
                        older.append(start_to_answer(
                            agent_argv(port, s.tmp / f"before{i}"), port, "/healthz",
                            {**env, "PYTHONPATH": str(before)})[0])
                    continue
                if who == "floor":
                    took, cpu, _, rss = start_to_answer(
                        [sys.executable, "-c", FLOOR, str(port)], port, "/", env)
                    floor_s.append(took)
                    floor_cpu.append(cpu)
                    floor_rss.append(rss)
                    continue
                log_path = s.tmp / f"agent{i}.log"
                took, cpu, wall0, rss = start_to_answer(
                    agent_argv(port, s.tmp / f"state{i}"), port, "/healthz", env, log_path)
                marks.append(log_marks(log_path, wall0))
                agent_s.append(took)
                agent_cpu.append(cpu)
                agent_rss.append(rss)
            log(f"start {i + 1}/{repeats}: floor {floor_s[-1] * 1000:.0f} ms, agent "
                f"{agent_s[-1] * 1000:.0f} ms")
    # Re-adoption, ``adopt_repeats`` times, each between two floor starts: one re-adoption is
    # one sample of a shared machine's moment, so it is judged as the start is, against the
    # floor beside it (the mean of the two), the median of those ratios.
    adoptions: list[Result] = []
    adopt_floor: list[float] = []
    for _ in range(adopt_repeats):
        port = free_port()
        around = [start_to_answer([sys.executable, "-c", FLOOR, str(port)], port, "/", env)[0]]
        adoptions.append(bench_readoption.run(engines))
        port = free_port()
        around.append(start_to_answer([sys.executable, "-c", FLOOR, str(port)], port, "/",
                                      env)[0])
        adopt_floor.append(statistics.mean(around))
    adopt_all = [float(r.details["all_ready_s"]) for r in adoptions]
    readoption = adoptions[sorted(range(len(adoptions)), key=adopt_all.__getitem__)[
        len(adoptions) // 2]]  # the median run's lines are shown
    loaded = bench_scale.run(engines=scale, idle_s=5.0, requests=20) if scale else None
    load1 = os.getloadavg()
    floor, agent = statistics.median(floor_s), statistics.median(agent_s)
    f_rss, a_rss = statistics.median(floor_rss), statistics.median(agent_rss)
    adopt_s = statistics.median(adopt_all)
    restarts = sum(int(r.details["restarts"]) for r in adoptions)
    changed = sum(len(r.details["changed"]) for r in adoptions)
    # each start against the floor's beside it (same moment of the machine's load), then the
    # median of those: what the goal is judged on; the medians of each side are shown too
    paired = statistics.median(a / f for a, f in zip(agent_s, floor_s))
    cpu_ratio = statistics.median(agent_cpu) / statistics.median(floor_cpu)
    ratios = {"start": paired,
              "readoption": statistics.median(a / f for a, f in zip(adopt_all, adopt_floor))}
    over = (a_rss - f_rss) / 2**20
    table = [
        "| figure | floor | agent | ratio | goal |",
        "|---|---|---|---|---|",
        f"| process start to first answer (median of {repeats}; ratio: median of each start "
        f"over the floor's beside it) | {floor * 1000:.0f} ms | {agent * 1000:.0f} ms | "
        f"{ratios['start']:.2f}x | <= {GOALS['start']}x |",
        *([f"| the same, the agent of {before} (median) | {floor * 1000:.0f} ms | "
           f"{statistics.median(older) * 1000:.0f} ms | "
           f"{statistics.median(o / f for o, f in zip(older, floor_s)):.2f}x | |"]
          if older else []),
        f"| CPU spent by then (median) | {statistics.median(floor_cpu) * 1000:.0f} ms | "
        f"{statistics.median(agent_cpu) * 1000:.0f} ms | {cpu_ratio:.2f}x | |",
        f"| RSS, answered and settled (agent: no engine) | {_mib(f_rss)} | {_mib(a_rss)} | "
        f"+{over:.1f} MiB | <= +{RSS_GOAL_MIB:g} MiB |",
        *([f"| RSS with {scale} engines active (`bench.bench_scale`) | | "
           f"{_mib(loaded.details['rss_bytes'])} | | |"] if loaded is not None else []),
        f"| re-adopt {engines} engines after SIGKILL: process start to all ready (median of "
        f"{adopt_repeats}; ratio: median of each over the floor's beside it) | "
        f"{statistics.median(adopt_floor) * 1000:.0f} ms | {adopt_s * 1000:.0f} ms "
        f"({restarts} restarted, {changed} changed) | {ratios['readoption']:.2f}x | "
        f"<= {GOALS['readoption']}x, none restarted |",
    ]
    mark = {key: statistics.median(m[key] for m in marks if key in m)
            for key in bench_readoption.MARKS if any(key in m for m in marks)}
    spread = [
        "the agent's log, median ms after Popen: " + ", ".join(
            f"{key} {value:.0f}" for key, value in mark.items()),
        f"floor start: {', '.join(f'{t * 1000:.0f}' for t in floor_s)} ms; agent start: "
        f"{', '.join(f'{t * 1000:.0f}' for t in agent_s)} ms",
        f"load average (1, 5, 15 min) at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, "
        f"at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} on {os.cpu_count()} cores",
        f"re-adoption: {', '.join(f'{a * 1000:.0f}' for a in adopt_all)} ms; the floor beside "
        f"each: {', '.join(f'{f * 1000:.0f}' for f in adopt_floor)} ms; the median run:",
        *readoption.lines,
    ]
    passed = (ratios["start"] <= GOALS["start"] and ratios["readoption"] <= GOALS["readoption"]
              and over <= RSS_GOAL_MIB and restarts == 0 and changed == 0)
    return Result(
        figure=f"15. start-up against the floor ({repeats} starts each, {engines} re-adopted)",
        goal=f"start <= {GOALS['start']}x the floor, re-adoption <= {GOALS['readoption']}x, "
             f"RSS <= floor + {RSS_GOAL_MIB:g} MiB",
        measured=f"start {ratios['start']:.2f}x, re-adoption {ratios['readoption']:.2f}x, "
                 f"RSS +{over:.1f} MiB",
        passed=passed, lines=[*table, "", *spread],
        details={"floor_s": floor_s, "agent_s": agent_s, "floor_cpu": floor_cpu,
                 "agent_cpu": agent_cpu, "floor_rss": floor_rss,
                 "agent_rss": agent_rss, "readoption_s": adopt_all,
                 "readoption_floor_s": adopt_floor, "marks": marks},
        headline=("start ratio to the floor", ratios["start"]))


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--engines", type=int, default=32)
    p.add_argument("--scale", type=int, default=64, metavar="N",
                   help="also the agent's RSS with N engines active (0: not measured)")
    p.add_argument("--before", type=Path, default=None, metavar="DIR",
                   help="another source tree whose agent's start is measured beside (main's)")
    p.add_argument("--adopt-repeats", type=int, default=3, metavar="N",
                   help="re-adoptions, each judged against floor starts beside it")
    args = p.parse_args()
    return run_main(lambda: run(args.repeats, args.engines, args.before, args.scale,
                                args.adopt_repeats))


if __name__ == "__main__":
    sys.exit(main())
