"""Figure 6: an engine's initial KV limit is in force soon after its kvcached segment appears.

For each sample the bench activates an engine with ``kv_limit_bytes`` and watches the engine's
segment file itself about every 1 ms from a thread; the figure is the agent's ``KVLimitSet``
event ts (written after the limit was read back from the segment) minus the moment the bench
first saw the file. Engines use --sim-startup-seconds spread over 0.2..1.0 s so the agent's
watch is caught at different phases; each is deactivated after its sample.

    python -m bench.bench_kv [--samples 32]
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    Events,
    Result,
    count_main,
    fmt_summary,
    log,
    session,
    summary_ms,
)
from contract.names import ipc_name_for
from contract.quantity import GiB

GOAL_P99_MS = 200.0


def watch_for(path: Path, seen: dict[str, float], timeout_s: float = 20.0) -> threading.Thread:
    """A thread that records time.time() when ``path`` first exists (about every 1 ms)."""
    def run() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists():
                seen["at"] = time.time()
                return
            time.sleep(0.001)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def limit_set(model: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("model") == model and e.get("reason") == "KVLimitSet"


def run(samples: int = 32) -> Result:
    lo, hi = 0.2, 1.0
    deltas: list[float] = []
    with session("kv") as s:
        agent = s.agent()
        events = Events(agent)
        for i in range(samples):
            name = f"kv-{i:02d}"
            startup = lo + (hi - lo) * i / max(1, samples - 1)
            seen: dict[str, float] = {}
            watcher = watch_for(agent.shm_dir / ipc_name_for(name), seen)
            agent.activate_sim(name, f"--sim-startup-seconds={startup:.3f}", kv_limit_bytes=GiB)
            watcher.join()
            if "at" not in seen:
                raise TimeoutError(f"{name}: the segment never appeared")
            event = events.wait_for(limit_set(name), 15, f"{name} KVLimitSet")
            deltas.append(max(0.0, event["ts"] - seen["at"]))
            agent.client.deactivate(name)
            if (i + 1) % 8 == 0:
                log(f"kv: {i + 1}/{samples} samples")
    st = summary_ms(deltas)
    return Result(
        figure="6. initial KV limit in force (segment appears -> KVLimitSet, read back)",
        goal=f"p99 <= {GOAL_P99_MS:g} ms, >= 30 samples",
        measured=fmt_summary(st, ("p50", "p90", "p99")),
        headline=("p99 ms", st["p99"]),
        passed=st["n"] >= 30 and st["p99"] <= GOAL_P99_MS, details={"stats_ms": st},
        lines=[f"{samples} engines, startup {lo}..{hi} s, bench looks for the segment every ~1 ms",
               f"latency: {fmt_summary(st, ('min', 'p50', 'p90', 'p99', 'max', 'mean'))}"],
    )


def main() -> int:
    return count_main(run, __doc__, "--samples", 32)


if __name__ == "__main__":
    sys.exit(main())
