"""Fault campaign: random faults against a real agent and its engines, invariants after each.

    python -m bench.faults [--seconds 120] [--seed 1] [--models 4]

For a set time it injects, at random: SIGKILL of an engine, SIGSTOP of an engine (briefly, or
for longer than the agent's grace), SIGKILL of the agent and a restart on the same state
directory, a record file corrupted while no agent runs, a state directory filled up and freed
(when a tmpfs can be mounted), storms of concurrent API calls (valid and invalid), sleeps and
wakes, and deactivations followed by new activations. After each step it checks:

1. the snapshot agrees with every engine that answers (active: awake; sleeping: asleep)
   within 2 s;
2. an engine that does not answer is reported not ready within the detection bound;
3. every engine process has a record and every live record a process;
4. nothing of a deactivated engine is left;
5. every call answered within its bound, and never with a 5xx unless an engine failed (502)
   or the agent said it could not (503, with why).

It prints the faults injected by kind and every invariant violation, and exits non-zero on any
violation. ``bench/RESULTS.md`` records a run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import Session, log
from registry.identity import scan_engines
from registry.env import ENV_ENGINE_ID
from runtime_agent.client import AgentError
from tests.harness import AgentProcess

ARGS = ("--health-interval", "0.5", "--unresponsive-after", "2", "--unresponsive-grace", "3",
        "--budget-reset", "20")
AGREE_S = 2.0  # the snapshot agrees with an answering engine within this
DETECT_S = 2 * (0.5 + 2.0) + 1.0  # misses x (interval + probe timeout) + one interval
SETTLE_S = 20.0  # restarts with backoff, re-adoption: records and processes match by then
CALL_BOUND_S = 30.0


def engine_says_sleeping(port: int) -> bool | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/is_sleeping", timeout=1) as r:
            return bool(json.loads(r.read())["is_sleeping"])
    except (OSError, ValueError, KeyError):
        return None


def call(agent: AgentProcess, method: str, path: str, body: Any = None) -> tuple[int, float]:
    data = None if body is None else (body if isinstance(body, bytes) else
                                      json.dumps(body).encode())
    req = urllib.request.Request(agent.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    began = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=CALL_BOUND_S + 5) as resp:
            resp.read()
            return resp.status, time.monotonic() - began
    except urllib.error.HTTPError as exc:
        return exc.code, time.monotonic() - began
    except OSError:
        return -1, time.monotonic() - began


class Campaign:
    def __init__(self, sess: Session, seed: int, n_models: int, disk: Path | None) -> None:
        self.sess = sess
        self.rng = random.Random(seed)
        self.state_dir = (disk or sess.tmp) / "state"
        self.agent = sess.agent(self.state_dir, extra_args=ARGS)
        self.names = [f"m{i}" for i in range(n_models)]
        self.deactivated: dict[str, str] = {}  # model -> engine id it had
        self.faults: Counter[str] = Counter()
        self.violations: list[str] = []
        self.slowest_agreement = 0.0
        self.disk = disk
        self.stopped: set[int] = set()

    # ---- helpers --------------------------------------------------------------------------

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {m["model_name"]: m for m in self.agent.client.snapshot()["models"]}

    def violation(self, what: str) -> None:
        log(f"VIOLATION: {what}")
        self.violations.append(what)

    def activate(self, name: str) -> None:
        try:
            self.agent.activate_sim(name, "--sim-sleep-seconds=0.2", "--sim-wake-seconds=0.2",
                                    "--sim-spawn-child=")
        except AgentError as exc:
            if exc.status >= 500 and exc.status not in (502, 503):
                self.violation(f"activate {name} answered {exc.status}: {exc}")

    def running(self) -> list[dict[str, Any]]:
        return [m for m in self.snapshot().values() if m["pid"] and m["alive"]]

    # ---- faults -----------------------------------------------------------------------------

    def kill_engine(self) -> None:
        if live := self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.rng.choice(live)["pid"], signal.SIGKILL)

    def stop_engine(self, long: bool) -> None:
        if not (live := self.running()):
            return
        pid = self.rng.choice(live)["pid"]
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        self.stopped.add(pid)
        if long:
            self.check_not_ready(pid)
        time.sleep(0.2 if not long else 0)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self.stopped.discard(pid)

    def kill_agent(self, corrupt: bool = False) -> None:
        old = self.agent
        old.kill()
        if corrupt:
            records = list((self.state_dir / "engines").glob("*.json"))
            if records:
                path = self.rng.choice(records)
                spoil = self.rng.choice([b"", b"{not json", b'{"phase": "hibernating"}'])
                if spoil == b'{"phase": "hibernating"}':
                    data = json.loads(path.read_text())
                    data["phase"] = "hibernating"
                    spoil = json.dumps(data).encode()
                path.write_bytes(spoil)
        self.agent = self.sess.agent(self.state_dir, same_ports_as=old, extra_args=ARGS)

    def fill_disk(self) -> None:
        assert self.disk is not None
        filler = self.disk / "filler"
        with filler.open("wb") as out, contextlib.suppress(OSError):
            for _ in range(64):
                out.write(b"\0" * (1 << 20))
                out.flush()
        self.kill_engine()  # a crash now cannot be written down
        time.sleep(1.0)
        self.storm(10)  # refusals say 503 and why; nothing answers 500
        filler.unlink()

    def storm(self, n: int = 40) -> None:
        names = self.names + ["ghost"]
        bodies = [
            lambda: ("POST", "/v1/runtime/models/sleep", {"model_name": self.rng.choice(names)}),
            lambda: ("POST", "/v1/runtime/models/wake", {"model_name": self.rng.choice(names)}),
            lambda: ("POST", "/v1/runtime/models/kv-limit",
                     {"model_name": self.rng.choice(names), "limit_bytes": 1 << 30}),
            lambda: ("GET", "/v1/runtime/snapshot", None),
            lambda: ("GET", "/v1/runtime/models", None),
            lambda: ("POST", "/v1/runtime/models/activate", b"{not json"),
            lambda: ("POST", "/v1/runtime/models/activate",
                     {"model_name": "../x", "artifact_url": "hf://a/b"}),
            lambda: ("POST", "/v1/runtime/models/sleep", {"model_name": 1.5}),
        ]
        requests = [self.rng.choice(bodies)() for _ in range(n)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda r: (r, call(self.agent, *r)), requests))
        for (method, path, _), (status, took) in answers:
            self.faults["storm request"] += 1
            if took > CALL_BOUND_S:
                self.violation(f"{method} {path} took {took:.1f} s")
            if status == -1 or status == 500 or (status >= 500 and status not in (502, 503)):
                self.violation(f"{method} {path} answered {status}")

    def sleep_or_wake(self) -> None:
        name = self.rng.choice(self.names)
        if name in self.deactivated:
            return
        with contextlib.suppress(AgentError, OSError):
            (self.agent.client.sleep if self.rng.random() < 0.5 else self.agent.client.wake)(name)

    def churn(self) -> None:
        name = self.rng.choice(self.names)
        if name in self.deactivated:
            self.deactivated.pop(name)
            self.activate(name)
            return
        model = self.snapshot().get(name)
        if model is None:
            return
        try:
            self.agent.client.deactivate(name)
        except AgentError as exc:
            if exc.status != 503:
                self.violation(f"deactivate {name} answered {exc.status}: {exc}")
            return
        self.deactivated[name] = model["engine_id"]

    # ---- invariants -------------------------------------------------------------------------

    def check_not_ready(self, pid: int) -> None:
        began = time.monotonic()
        while time.monotonic() - began < DETECT_S:
            owner = next((m for m in self.snapshot().values() if m["pid"] == pid), None)
            if owner is None or not owner["ready"]:
                return
            time.sleep(0.1)
        self.violation(f"pid {pid} stopped, still ready after {DETECT_S:.1f} s")

    def check(self) -> None:
        self.check_agreement()
        self.check_records_and_processes()
        self.check_nothing_left()

    def check_agreement(self) -> None:
        began = time.monotonic()
        while True:
            bad = []
            for m in self.snapshot().values():
                if m["phase"] not in ("active", "sleeping") or not m["alive"]:
                    continue
                if m["operation"] is not None or m["pid"] in self.stopped:
                    continue
                says = engine_says_sleeping(m["port"])
                if says is not None and says != (m["phase"] == "sleeping"):
                    bad.append(f"{m['model_name']} reads {m['phase']}, its engine says "
                               f"{'asleep' if says else 'awake'}")
            took = time.monotonic() - began
            if not bad:
                self.slowest_agreement = max(self.slowest_agreement, took)
                return
            if took > AGREE_S:
                self.violation("; ".join(bad) + f" for over {AGREE_S:g} s")
                return
            time.sleep(0.1)

    def check_records_and_processes(self) -> None:
        began = time.monotonic()
        while True:
            snap = self.snapshot()
            leaders = {f.pid: f.environ[ENV_ENGINE_ID]
                       for f in scan_engines(str(self.state_dir)) if f.leads_its_group}
            known = {m["pid"] for m in snap.values() if m["pid"]}
            orphans = sorted(set(leaders) - known)
            missing = sorted(n for n, m in snap.items()
                             if m["phase"] in ("active", "sleeping") and m["pid"] not in leaders)
            if not orphans and not missing:
                return
            if time.monotonic() - began > SETTLE_S:
                self.violation(f"processes without a record {orphans}; records without a "
                               f"process {missing}")
                return
            time.sleep(0.2)

    def check_nothing_left(self) -> None:
        for name, engine_id in self.deactivated.items():
            left = [f.pid for f in scan_engines(str(self.state_dir), every=True)
                    if f.environ[ENV_ENGINE_ID] == engine_id]
            if left:
                self.violation(f"{name} deactivated, its processes {left} remain")

    # ---- the run ------------------------------------------------------------------------------

    def run(self, seconds: float) -> None:
        for name in self.names:
            self.activate(name)
        for name in self.names:
            self.agent.wait_phase(name, "active", timeout_s=60)
        kinds = [("kill engine", 6, self.kill_engine),
                 ("stop engine briefly", 3, lambda: self.stop_engine(False)),
                 ("stop engine past the grace", 1, lambda: self.stop_engine(True)),
                 ("kill agent", 2, self.kill_agent),
                 ("corrupt a record, kill agent", 1, lambda: self.kill_agent(corrupt=True)),
                 ("API storm", 3, self.storm),
                 ("sleep or wake", 4, self.sleep_or_wake),
                 ("deactivate or activate", 2, self.churn)]
        if self.disk is not None:
            kinds.append(("fill the state directory", 1, self.fill_disk))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            kind, _, fault = self.rng.choices(kinds, weights=[w for _, w, _ in kinds])[0]
            self.faults[kind] += 1
            fault()
            self.check()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--models", type=int, default=4)
    args = parser.parse_args(argv)
    began = time.monotonic()
    sess = Session("faults")
    disk = sess.tmp / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)],
        capture_output=True).returncode == 0
    try:
        campaign = Campaign(sess, args.seed, args.models, disk if mounted else None)
        campaign.run(args.seconds)
    finally:
        for agent in sess.agents:  # engines first, while the state directory is still there
            with contextlib.suppress(Exception):
                agent.cleanup()
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
        sess.close()
    total = sum(campaign.faults.values())
    print(f"fault campaign: {time.monotonic() - began:.0f} s, seed {args.seed}, "
          f"{args.models} models, state directory on {'a 32 MiB tmpfs' if mounted else 'disk'}")
    print(f"faults injected: {total}")
    for kind, n in campaign.faults.most_common():
        print(f"  {n:6d}  {kind}")
    print(f"slowest agreement of snapshot and engines after a fault: "
          f"{campaign.slowest_agreement:.2f} s (bound {AGREE_S:g} s)")
    print(f"invariant violations: {len(campaign.violations)}")
    for v in campaign.violations:
        print(f"  - {v}")
    return 1 if campaign.violations else 0


if __name__ == "__main__":
    sys.exit(main())
