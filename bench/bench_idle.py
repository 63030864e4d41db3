"""Idle cost with 64 engines (issue 26 item 3): what supervision costs the agent and the engines.

The agent runs with its production intervals (health probe, ``--scrape-interval 2``,
``--kv-hold-interval 1``, GPU sample every second) on 8 simulated cards. 64 simulated engines
are activated (at most MAX_BOOTING starting at a time: the machine has 2 cores) and left to
settle for ``--settle`` seconds with no API traffic, so steady engines have backed off. Then two
windows of ``--seconds`` each:

1. *probed*: the agent's CPU (``psutil`` ``cpu_times``, user + system, % of one core) and the
   engines' CPU summed over their processes, and the probes and scrapes each engine answered
   (the simulated engine counts its requests by path: ``requests_seen`` in ``/sim/state``);
2. *unprobed*: the agent stopped (SIGSTOP), so nothing asks the engines anything; the engines'
   CPU then is their own idle cost (the simulated engine follows its memory 20 times a second).

The engines' CPU spent answering the agent is window 1's less window 2's. The agent's RSS is
read with no engine and with all of them. Targets from the issue: agent idle CPU <= 3% of a
core, engines' probe-answering CPU <= 10% of a core in total. Prints a markdown table.

    python -m bench.bench_idle [--engines 64] [--gpus 8x80GiB] [--settle 20] [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import psutil

from bench.bench_scale import ENGINE_FLAGS, MAX_BOOTING, cpu_seconds
from bench.common import Result, activate_many, log, session, snapshot_models
from tests.harness import http_json

AGENT_GOAL_PCT = 3.0
ENGINES_GOAL_PCT = 10.0
PROBE_PATHS = ("/health", "/is_sleeping")
# The harness's fast test intervals put back to the production defaults.
PRODUCTION = ["--scrape-interval", "2", "--kv-hold-interval", "1", "--gpu-sample-interval", "1"]


def requests_seen(ports: list[int]) -> dict[str, int]:
    """Every engine's requests by path, summed (``/sim/state`` itself is not counted)."""
    total: dict[str, int] = {}
    for port in ports:
        status, body = http_json(f"http://127.0.0.1:{port}/sim/state", timeout=10)
        assert status == 200, body
        for path, n in body.get("requests_seen", {}).items():
            total[path] = total.get(path, 0) + int(n)
    return total


def window(seconds: float, agent: psutil.Process | None,
           engines: list[psutil.Process]) -> tuple[float, float]:
    """CPU of the agent and of the engines over ``seconds``, each in % of one core."""
    a0, e0, t0 = cpu_seconds([agent] if agent else []), cpu_seconds(engines), time.monotonic()
    time.sleep(seconds)
    a1, e1, t1 = cpu_seconds([agent] if agent else []), cpu_seconds(engines), time.monotonic()
    return (a1 - a0) / (t1 - t0) * 100, (e1 - e0) / (t1 - t0) * 100


def run(engines: int = 64, gpus: str = "8x80GiB", settle_s: float = 20.0,
        seconds: float = 60.0, agent_args: Sequence[str] = ()) -> Result:
    names = [f"idle-{i:02d}" for i in range(engines)]
    mib = 1024 * 1024
    with session("idle") as s:
        agent = s.agent(ports=engines + 36, extra_args=["--simulate-gpus", gpus, *PRODUCTION,
                                                          *agent_args])
        assert agent.proc is not None
        me = psutil.Process(agent.proc.pid)
        rss_none = me.memory_info().rss
        act = activate_many(agent, names, lambda _: ENGINE_FLAGS, max_booting=MAX_BOOTING,
                            timeout_s=300)
        models = snapshot_models(agent)
        assert all(m["phase"] == "active" and m["ready"] for m in models.values())
        procs = [psutil.Process(m["pid"]) for m in models.values()]
        ports = [int(m["port"]) for m in models.values()]
        log(f"idle: {engines} active after {act['all_active_s']:.1f} s; settling {settle_s:g} s")
        time.sleep(settle_s)
        n0, seen0 = agent.client.snapshot()["node"], requests_seen(ports)
        agent_pct, probed_pct = window(seconds, me, procs)
        n1, seen1 = agent.client.snapshot()["node"], requests_seen(ports)
        log(f"idle: agent {agent_pct:.2f}%, engines {probed_pct:.2f}%; now unprobed")
        os.kill(me.pid, signal.SIGSTOP)
        try:
            _, unprobed_pct = window(seconds, None, procs)
        finally:
            os.kill(me.pid, signal.SIGCONT)
        rss = me.memory_info().rss
        restarts = sum(m["restart_count"] for m in snapshot_models(agent).values())
    per_s = engines * seconds

    def rate(paths: tuple[str, ...]) -> float:
        return sum(seen1.get(p, 0) - seen0.get(p, 0) for p in paths) / per_s

    samples = (n1["gpu_samples_total"] - n0["gpu_samples_total"]) / seconds
    answering = probed_pct - unprobed_pct
    passed = agent_pct <= AGENT_GOAL_PCT and answering <= ENGINES_GOAL_PCT and restarts == 0
    rows = [
        ("agent idle CPU, % of a core", f"<= {AGENT_GOAL_PCT:g}", f"{agent_pct:.2f}"),
        ("engines' CPU answering the agent (probed - unprobed), % of a core, total",
         f"<= {ENGINES_GOAL_PCT:g}", f"{answering:.2f}"),
        ("engines' CPU probed / unprobed (SIGSTOPped agent), % of a core, total", "",
         f"{probed_pct:.2f} / {unprobed_pct:.2f}"),
        ("health probes per engine per second (/is_sleeping, /health)", "",
         f"{rate(PROBE_PATHS):.3f}"),
        ("scrapes per engine per second (/metrics)", "", f"{rate(('/metrics',)):.3f}"),
        ("GPU samples per second", "", f"{samples:.2f}"),
        (f"agent RSS with {engines} engines (with none), MiB", "",
         f"{rss / mib:.1f} ({rss_none / mib:.1f})"),
        ("restarts during the run", "0", str(restarts)),
    ]
    extra = f" --agent-args '{shlex.join(agent_args)}'" if agent_args else ""
    table = [f"`python -m bench.bench_idle --engines {engines} --gpus {gpus} --settle "
             f"{settle_s:g} --seconds {seconds:g}{extra}`; {engines} active after "
             f"{act['all_active_s']:.1f} s; 1-min load average {os.getloadavg()[0]:.1f}", "",
             "| figure | target | measured |", "|---|---|---|",
             *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    details: dict[str, Any] = {"agent_pct": agent_pct, "answering_pct": answering,
                               "probed_pct": probed_pct, "unprobed_pct": unprobed_pct,
                               "rss_bytes": rss, "rss_none_bytes": rss_none, "table": table}
    return Result(
        figure=f"idle cost ({engines} engines on {gpus})",
        goal=f"agent <= {AGENT_GOAL_PCT:g}% of a core, engines answering its probes <= "
             f"{ENGINES_GOAL_PCT:g}% in total, over {seconds:g} s",
        measured=f"agent {agent_pct:.2f}%, engines answering {answering:.2f}%, RSS "
                 f"{rss / mib:.0f} MiB", passed=passed, details=details, lines=table[:1],
        headline=("agent idle CPU %", agent_pct))


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--gpus", default="8x80GiB")
    p.add_argument("--settle", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--agent-args", default="", help="more agent flags, e.g. to compare intervals")
    args = p.parse_args()
    result = run(args.engines, args.gpus, args.settle, args.seconds, shlex.split(args.agent_args))
    print(result.report(), flush=True)
    print("\n".join(result.details["table"]), flush=True)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
