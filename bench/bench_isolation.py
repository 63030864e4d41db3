"""Figure 3: API isolation: snapshot latency while slow engine calls are in flight.

8 engines run with --sim-sleep-seconds=5 --sim-wake-seconds=5. The bench issues sleep on all 8
at once (one thread each) and, while those calls are in flight, a separate thread reads
GET /v1/runtime/snapshot every 10 ms over its own keep-alive connection, timing each read. Then
the same for wake. An agent that held one lock across engine calls would stall snapshots for the
whole 5 s.

    python -m bench.bench_isolation [--engines 8] [--seconds 5]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

from bench.common import (
    FastClient,
    Result,
    activate_many,
    fmt_summary,
    log,
    run_main,
    session,
    summary_ms,
)
from runtime_agent.client import AgentClient

GOAL_P99_MS = 20.0
SAMPLE_EVERY_S = 0.010


def sample_during(url: str, names: list[str], action: str) -> dict[str, Any]:
    """Run ``action`` on every model concurrently; time snapshots until all calls returned."""
    latencies: list[float] = []
    phases_seen: set[str] = set()
    done = threading.Event()
    results: dict[str, Any] = {}

    def sampler() -> None:
        client = FastClient(url)
        try:
            while not done.is_set():
                t = time.perf_counter()
                elapsed, status, body = client.get("/v1/runtime/snapshot")
                assert status == 200, status
                latencies.append(elapsed)
                phases_seen.update(m.get("operation") or "-" for m in body["models"])
                time.sleep(max(0.0, SAMPLE_EVERY_S - (time.perf_counter() - t)))
        finally:
            client.close()

    def call(name: str) -> None:
        client = AgentClient(url, timeout_s=60)
        started = time.monotonic()
        try:
            body = getattr(client, action)(name)
            results[name] = (body.get("status"), time.monotonic() - started)
        except Exception as exc:  # recorded, reported below
            results[name] = (f"error: {exc}", time.monotonic() - started)

    sampler_thread = threading.Thread(target=sampler, name="sampler")
    sampler_thread.start()
    time.sleep(0.05)  # a few baseline samples before the calls
    callers = [threading.Thread(target=call, args=(n,)) for n in names]
    t0 = time.monotonic()
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    window = time.monotonic() - t0
    done.set()
    sampler_thread.join()
    bad = {n: r for n, r in results.items() if r[0] != "success"}
    return {"latencies": latencies, "window_s": window, "bad": bad,
            "call_s": sorted(r[1] for r in results.values()),
            "operations_seen": sorted(phases_seen)}


def run(engines: int = 8, seconds: float = 5.0) -> Result:
    names = [f"iso-{i}" for i in range(engines)]
    flags = [f"--sim-sleep-seconds={seconds:g}", f"--sim-wake-seconds={seconds:g}",
             "--sim-startup-seconds=0.1"]
    out: dict[str, dict[str, Any]] = {}
    with session("isolation") as s:
        agent = s.agent()
        activate_many(agent, names, lambda _: flags)
        for action in ("sleep", "wake"):
            out[action] = sample_during(agent.url, names, action)
            log(f"isolation: {action} window {out[action]['window_s']:.2f} s, "
                f"{len(out[action]['latencies'])} snapshots")
        phases = sorted({m["phase"] for m in agent.client.snapshot()["models"]})
    stats = {a: summary_ms(o["latencies"]) for a, o in out.items()}
    both = summary_ms(out["sleep"]["latencies"] + out["wake"]["latencies"])
    calls_ok = not out["sleep"]["bad"] and not out["wake"]["bad"]
    passed = calls_ok and both["p99"] <= GOAL_P99_MS and all(
        o["window_s"] >= seconds * 0.9 for o in out.values())
    lines = []
    for action, o in out.items():
        lines.append(f"during {engines} concurrent {action} calls ({o['window_s']:.2f} s window; "
                     f"calls took {o['call_s'][0]:.2f}..{o['call_s'][-1]:.2f} s; "
                     f"operations seen: {o['operations_seen']}): "
                     f"{fmt_summary(stats[action], ('p50', 'p99', 'max'))}")
        if o["call_s"][-1] > 1.5 * seconds:
            lines.append(f"  NOTE: the agent did not run these {action} calls concurrently: they "
                         f"returned after {', '.join(f'{c:.1f}' for c in o['call_s'])} s for a "
                         f"{seconds:g} s engine call each")
        if o["bad"]:
            lines.append(f"  FAILED calls: {o['bad']}")
    lines.append(f"phases at the end: {phases}")
    return Result(
        figure=f"3. API isolation (snapshot latency during {engines}x{seconds:g} s sleep/wake calls)",
        goal=f"snapshot p99 <= {GOAL_P99_MS:g} ms",
        measured=fmt_summary(both, ("p50", "p99", "max")),
        headline=("p99 ms", both["p99"]),
        passed=passed, details={"stats_ms": stats, "both_ms": both}, lines=lines,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    return run_main(lambda: run(args.engines, args.seconds))


if __name__ == "__main__":
    sys.exit(main())
