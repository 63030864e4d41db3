"""Two measured costs (issue 12), before and after, side by side in one run.

(a) The snapshot under a burst: 64 engines on 8 simulated cards; ``wrk`` (C, 2 threads, 50
    connections) reads ``/v1/runtime/snapshot`` for ``--seconds`` while a Python sampler reads
    ``/healthz`` every 20 ms on its own keep-alive connection and, where the agent has one, a
    second one reads the probe port's ``/healthz`` (``--health-probe-port``) every 20 ms on a new
    connection each time, as the kubelet does. Recorded: wrk's requests/s and latency
    percentiles, and each /healthz's p50/p99 during the burst. Goals: 10x the throughput of the
    old agent and /healthz p99 under 10 ms during the burst.
(b) 64 engines that declare nothing (no ``per_gpu``) on 8 cards, activated together: the time
    from the first activate to the last ``active`` event. The old agent put them all on card 0,
    where they start one at a time behind its start gate.

``--before PATH`` is a checkout of the code to compare with (e.g. ``git worktree add
/tmp/before 4ed586b``); both agents run with this machine's Python environment.

    python -m bench.bench_costs --before /tmp/before [--engines 64] [--seconds 10]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Session, log, percentile, session
from tests.harness import ROOT, AgentProcess

STARTUP_S = "0.3"


def start_engines(agent: AgentProcess, n: int) -> float:
    """Activate ``n`` undeclared engines at once; seconds to the last one active."""
    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: agent.activate_sim(f"e{i:02d}", f"--sim-startup-seconds={STARTUP_S}"),
                      range(n)))
    agent.wait_for(lambda s: sum(m["phase"] == "active" for m in s["models"]) == n,
                   timeout_s=600, what=f"{n} engines active", poll_s=0.2)
    return time.monotonic() - began


def healthz_sampler(port: int, stop: threading.Event, out: list[float],
                    keep_alive: bool = True) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    while not stop.is_set():
        began = time.perf_counter()
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        out.append(time.perf_counter() - began)
        if not keep_alive:  # the kubelet connects anew for every probe
            conn.close()
        time.sleep(0.02)
    conn.close()


def burst(agent: AgentProcess, seconds: float, probe_port: int | None) -> dict[str, Any]:
    health: list[float] = []
    probe: list[float] = []
    stop = threading.Event()
    samplers = [threading.Thread(target=healthz_sampler, args=(agent.port, stop, health))]
    if probe_port is not None:
        samplers.append(threading.Thread(target=healthz_sampler,
                                         args=(probe_port, stop, probe, False)))
    for sampler in samplers:
        sampler.start()
    try:
        out = subprocess.run(["wrk", "-t2", "-c50", f"-d{int(seconds)}s", "--latency",
                              f"{agent.url}/v1/runtime/snapshot"], capture_output=True,
                             text=True, timeout=seconds + 60).stdout
    finally:
        stop.set()
        for sampler in samplers:
            sampler.join()
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    lat = dict(re.findall(r"\s+(50|90|99)%\s+([\d.]+\w+)", out))
    return {"rps": rps, "p50": lat.get("50"), "p99": lat.get("99"),
            "healthz_p50_ms": percentile(health, 50) * 1000,
            "healthz_p99_ms": percentile(health, 99) * 1000, "healthz_n": len(health),
            "probe_p50_ms": percentile(probe, 50) * 1000 if probe else None,
            "probe_p99_ms": percentile(probe, 99) * 1000 if probe else None,
            "probe_n": len(probe)}


def measure(sess: Session, root: Path, label: str, engines: int, seconds: float,
            probe: bool = False) -> dict[str, Any]:
    agent = sess.agent(root=root, ports=engines + 20, extra_args=[
        "--simulate-gpus", "8x80GiB", "--scrape-interval", "2"],
        free_ports=["--health-probe-port"] if probe else [])
    probe_port = agent.ports.get("--health-probe-port")
    log(f"{label}: starting {engines} undeclared engines on 8 cards")
    start_s = start_engines(agent, engines)
    cards = sorted({m["devices"][0] for m in agent.client.snapshot()["models"]
                    if m.get("devices")})
    time.sleep(2)
    log(f"{label}: snapshot burst for {seconds:g} s")
    result = {"label": label, "start_s": start_s, "cards_used": len(cards),
              **burst(agent, seconds, probe_port)}
    agent.cleanup()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench_costs needs wrk (Debian's package wrk)", file=sys.stderr)
        return 2
    rows = []
    with session("costs") as sess:
        rows.append(measure(sess, args.before.resolve(), "before", args.engines, args.seconds))
        rows.append(measure(sess, ROOT, "after", args.engines, args.seconds, probe=True))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} cores")
    print(f"{'':8} {'start (s)':>13} {'cards':>6} {'snapshot req/s':>15} {'p50':>9} "
          f"{'p99':>9} {'healthz p50 ms':>15} {'healthz p99 ms':>15}")
    for r in rows:
        print(f"{r['label']:8} {r['start_s']:13.1f} {r['cards_used']:6d} {r['rps']:15.0f} "
              f"{r['p50']:>9} {r['p99']:>9} {r['healthz_p50_ms']:15.1f} "
              f"{r['healthz_p99_ms']:15.1f}")
    before, after = rows
    print(f"probe port /healthz (new connection each): p50 {after['probe_p50_ms']:.1f} ms, "
          f"p99 {after['probe_p99_ms']:.1f} ms over {after['probe_n']} probes")
    print(f"snapshot throughput x{after['rps'] / before['rps']:.1f} (goal x10); healthz p99 "
          f"{after['healthz_p99_ms']:.1f} ms on the API port, {after['probe_p99_ms']:.1f} ms "
          f"on the probe port (goal < 10 ms); start "
          f"{before['start_s']:.1f} s -> {after['start_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
