"""Shared plumbing for the benchmarks: agent sessions that always clean up, an events follower,
a keep-alive JSON client, staggered activation, and percentile summaries.

Every benchmark runs the real agent (``tests.harness.AgentProcess``: ``python -m
runtime_agent.cli serve --engines sim``) and talks to it only over its HTTP API.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from registry.identity import scan_engines
from tests.harness import AgentProcess

# ---- results ----------------------------------------------------------------------------------


@dataclass
class Result:
    figure: str
    goal: str
    measured: str
    passed: bool
    details: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)  # human-readable report lines
    # the one number whose spread over repeated runs is reported: (what it is, value)
    headline: tuple[str, float] | None = None

    def report(self) -> str:
        head = f"== {self.figure} =="
        body = "\n".join(f"  {line}" for line in self.lines)
        verdict = f"  goal: {self.goal}\n  measured: {self.measured}\n  " \
                  f"{'PASS' if self.passed else 'FAIL'}"
        return "\n".join(part for part in (head, body, verdict) if part)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (no interpolation): the smallest value with >= p% at or below it.
    With fewer than 100 samples p99 is therefore the maximum."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summary_ms(seconds: Iterable[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    if not ms:
        return {"n": 0}
    return {"n": len(ms), "min": min(ms), "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "max": max(ms), "mean": sum(ms) / len(ms)}


def fmt_summary(s: dict[str, float], keys: Sequence[str] = ("p50", "p90", "p99", "max")) -> str:
    if not s.get("n"):
        return "no samples"
    return ", ".join(f"{k} {s[k]:.1f} ms" for k in keys) + f" (n={int(s['n'])})"


def run_main(run: Callable[[], Result]) -> int:
    """Entry point shared by the bench modules: run, print the report, exit 0 on PASS."""
    result = run()
    print(result.report(), flush=True)
    return 0 if result.passed else 1


def count_main(run: Callable[[int], Result], doc: str | None, flag: str, default: int) -> int:
    """``main`` of a bench with one knob, a count (``--samples``, ``--engines``)."""
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument(flag, type=int, default=default, dest="count")
    args = p.parse_args()
    return run_main(lambda: run(args.count))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- agent sessions ---------------------------------------------------------------------------


class Session:
    """A temporary directory and the agents started in it; ``close`` kills every agent and every
    engine that carries one of the session's state directories, then removes the directory."""

    def __init__(self, name: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        self.agents: list[AgentProcess] = []

    def agent(self, state_dir: Path | None = None, *, start: bool = True,
              same_ports_as: AgentProcess | None = None, **kwargs: Any) -> AgentProcess:
        agent = AgentProcess(state_dir or self.tmp / f"state{len(self.agents)}", **kwargs)
        if same_ports_as is not None:
            agent.port_low, agent.port_high = same_ports_as.port_low, same_ports_as.port_high
        # else: the harness already picks a block below the kernel's ephemeral range
        self.agents.append(agent)
        if start:
            agent.start()
        return agent

    def close(self) -> None:
        for agent in reversed(self.agents):
            with contextlib.suppress(Exception):
                agent.cleanup()
        leftovers: list[int] = []
        for state_dir in {a.state_dir for a in self.agents}:
            deadline = time.monotonic() + 10
            while True:
                found = scan_engines(str(state_dir))
                if not found or time.monotonic() > deadline:
                    leftovers += [f.pid for f in found]
                    break
                for f in found:  # cleanup() already signalled them; repeat for stragglers
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(f.pid, 9)
                time.sleep(0.1)
        if leftovers:
            log(f"WARNING: engine processes still alive after cleanup: {leftovers}")
        if os.environ.get("BENCH_KEEP"):
            log(f"keeping {self.tmp} (BENCH_KEEP is set)")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def session(name: str) -> Iterator[Session]:
    s = Session(name)
    try:
        yield s
    finally:
        s.close()


# ---- a keep-alive client for latency sampling -------------------------------------------------


class FastClient:
    """One keep-alive HTTP/1.1 connection; ``get`` returns (seconds, status, parsed JSON)."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def get(self, path: str) -> tuple[float, int, Any]:
        for attempt in range(2):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            t0 = time.perf_counter()
            try:
                self._conn.request("GET", path)
                resp = self._conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
                continue
            elapsed = time.perf_counter() - t0
            return elapsed, resp.status, json.loads(raw) if raw else None
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


# ---- events -----------------------------------------------------------------------------------


class Events:
    """Follows GET /v1/runtime/events from a cursor; keeps everything it has seen."""

    def __init__(self, agent: AgentProcess, since: int | None = None) -> None:
        self.agent = agent
        self.cursor = agent.client.events(0)["cursor"] if since is None else since
        self.seen: list[dict[str, Any]] = []

    def poll(self, wait: int = 0) -> list[dict[str, Any]]:
        page = self.agent.client.events(self.cursor, wait=wait)
        self.cursor = page["cursor"]
        self.seen.extend(page["events"])
        return list(page["events"])

    def wait_for(self, match: Callable[[dict[str, Any]], bool], timeout_s: float,
                 what: str = "event") -> dict[str, Any]:
        """The first event after the cursor that matches (already-seen events are not rechecked)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            for event in self.poll(wait=max(0, min(2, math.ceil(left)))):
                if match(event):
                    return event
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")


def transition(model: str, to: str, src: Collection[str] | None = None
               ) -> Callable[[dict[str, Any]], bool]:
    """An event matcher: ``model`` moved to phase ``to`` (from one of ``src``, if given)."""
    def match(event: dict[str, Any]) -> bool:
        return bool(event["model"] == model and event["to"] == to
                    and (src is None or event["from"] in src))
    return match


# ---- activation -------------------------------------------------------------------------------


def activate_many(agent: AgentProcess, names: Sequence[str], flags_for: Callable[[str], Sequence[str]],
                  max_booting: int = 6, timeout_s: float = 180.0) -> dict[str, Any]:
    """Activate ``names`` with at most ``max_booting`` engines starting at a time (each simulated
    engine costs a few tenths of a CPU second to start; the machine has 2 cores), and wait until
    every one is active. Returns activate responses, per-model active event ts and the timings."""
    events = Events(agent)
    pending: set[str] = set()
    active_ts: dict[str, float] = {}
    responses: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s

    def drain(wait: int) -> None:
        for event in events.poll(wait=wait):
            name = event["model"]
            if event["to"] == "failed":
                raise RuntimeError(f"{name} failed while activating: {event['message']}")
            if event["to"] == "active" and name in pending:
                pending.discard(name)
                active_ts[name] = event["ts"]
        if time.monotonic() > deadline:
            raise TimeoutError(f"activation timed out; still booting: {sorted(pending)}")

    t0 = time.time()
    for name in names:
        while len(pending) >= max_booting:
            drain(wait=1)
        responses[name] = agent.activate_sim(name, *flags_for(name))
        pending.add(name)
        drain(wait=0)
    while pending:
        drain(wait=1)
    return {"responses": responses, "active_ts": active_ts, "t0": t0,
            "all_active_s": max(active_ts.values()) - t0 if active_ts else 0.0}


def snapshot_models(agent: AgentProcess) -> dict[str, dict[str, Any]]:
    return {m["model_name"]: m for m in agent.client.snapshot()["models"]}
