"""Figure 2: readiness detection latency.

Right after each activate returns, the bench polls the new engine's /health itself about every
1 ms (raw socket: connect, ``GET /health HTTP/1.0``, read the status line). The moment the bench
reads its first 200 is "the engine started answering"; the figure is the agent's event ts for
that engine's move to "active" minus that moment. Engines use --sim-startup-seconds spread
evenly over 0.2..1.5 s so the phase of the agent's probe backoff differs per sample. Engines are
activated one at a time and deactivated after their sample, so every sample sees a quiet agent.

    python -m bench.bench_readiness [--samples 32]
"""

from __future__ import annotations

import socket
import sys
import time

from bench.common import (
    Events,
    Result,
    count_main,
    fmt_summary,
    log,
    session,
    summary_ms,
    transition,
)

GOAL_P50_MS = 50.0
REQUEST = b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"


def probe_once(port: int) -> tuple[bool, float]:
    """(answered 200, time.time() when the answer was read)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(REQUEST)
            data = b""
            while b"\r\n" not in data:
                chunk = sock.recv(256)
                if not chunk:
                    break
                data += chunk
            seen = time.time()
    except OSError:
        return False, time.time()
    return data.startswith(b"HTTP/1.") and data.split(b" ", 2)[1:2] == [b"200"], seen


def first_answer(port: int, timeout_s: float = 15.0, interval_s: float = 0.001) -> tuple[float, int]:
    """time.time() of the first 200 from the engine's /health, and how many probes it took."""
    deadline = time.monotonic() + timeout_s
    probes = 0
    while time.monotonic() < deadline:
        probes += 1
        ok, seen = probe_once(port)
        if ok:
            return seen, probes
        time.sleep(interval_s)
    raise TimeoutError(f"port {port} never answered /health")


def run(samples: int = 32) -> Result:
    lo, hi = 0.2, 1.5
    startups = [lo + (hi - lo) * i / max(1, samples - 1) for i in range(samples)]
    deltas: list[float] = []
    per_sample: list[tuple[float, float]] = []
    with session("readiness") as s:
        agent = s.agent()
        events = Events(agent)
        for i, startup in enumerate(startups):
            name = f"ready-{i:02d}"
            resp = agent.activate_sim(name, f"--sim-startup-seconds={startup:.3f}")
            answered_at, _ = first_answer(resp["port"])
            event = events.wait_for(transition(name, "active"), 15, f"{name} active")
            deltas.append(event["ts"] - answered_at)
            per_sample.append((startup, (event["ts"] - answered_at) * 1000))
            agent.client.deactivate(name)
            if (i + 1) % 8 == 0:
                log(f"readiness: {i + 1}/{samples} samples")
    st = summary_ms(deltas)
    passed = st["n"] >= 30 and st["p50"] <= GOAL_P50_MS
    return Result(
        figure="2. readiness detection (first /health 200 -> active event)",
        goal=f"p50 <= {GOAL_P50_MS:g} ms, >= 30 samples",
        measured=fmt_summary(st, ("p50", "p90", "p99")),
        headline=("p50 ms", st["p50"]),
        passed=passed, details={"stats_ms": st, "per_sample": per_sample},
        lines=[f"{samples} engines, startup {lo}..{hi} s, bench polls /health every ~1 ms",
               f"latency: {fmt_summary(st, ('min', 'p50', 'p90', 'p99', 'max', 'mean'))}"],
    )


def main() -> int:
    return count_main(run, __doc__, "--samples", 32)


if __name__ == "__main__":
    sys.exit(main())
