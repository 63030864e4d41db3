"""The truth table as a test: every cell of docs/fields.md "Fields by phase", on real processes.

One agent (then its successor on the same state directory, after a SIGKILL) runs simulated
engines, one or two per column; the walk brings each engine into its column's phase, then polls
the agent's snapshot, model list, ``/metrics`` and events every few tens of milliseconds, far
more often than the GPU is sampled, and checks every cell of that column against what is true
of the engine at that moment: its process (psutil), its report to the simulated GPU
(``<state>/sim-gpu/<pid>.json``), its kvcached segment in the shm directory, its own
``/metrics`` and ``/health``. A cell must first come true (figures lag by one sample) and then
stay true for every poll of the window, so a figure that flickers between samples fails.

``PENDING`` lists cells known to fail until another change lands (issue 22): such a cell must
fail, and the test errors when one passes, so the entry is removed with the fix. With
``TRUTH_REPORT=1`` the walk prints every column's failing cells instead of stopping at the
first column (for editing the table; the test then checks nothing).
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from runtime_agent.client import AgentError
from tests.harness import AgentProcess, complete, wait_until
from tests.test_readoption import restart_agent
from tests.truth_table import (COLUMNS, GIB, Moment, Truth, agent_metrics, check, engine_figures,
                               live, load_table)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

DOC = Path(__file__).resolve().parent.parent / "docs" / "fields.md"
KV_LIMIT = GIB
ABOVE_CAPACITY = 3 * GIB  # above the simulator's 2 GiB KV capacity
SAMPLE_S = 0.3  # --gpu-sample-interval
WINDOW_S = 2.0  # each column is polled this long after it first held (> HISTORY_S)
TRANSIENT = {"booting", "waking", "restarting", "stopping", "adopted booting"}
# (row, column) -> why the cell fails today: each must fail, and the test errors once one
# holds, so that the entry goes with the fix.
PENDING: dict[tuple[str, str], str] = {
    ('aibrix:modelclaim_lifecycle_operations_total{model,action="sleep",result="success"}',
     "adopted mid-sleep"): "a sleep the new agent sees through (its caller died with the old "
                           "agent) is counted nowhere: the series stays absent",
}
# column -> why it fails as a whole today (a whole column of `absent` with its engine there)
PENDING_COLUMNS: dict[str, str] = {}


class Walk:
    """The engines of the walk, what was asked of each, and the checks of every column."""

    def __init__(self, agent: AgentProcess, table: dict[str, dict[str, str]]) -> None:
        self.agent = agent
        self.table = table
        self.truth = Truth(agent.state_dir, agent.shm_dir)
        self.asked: dict[str, dict[str, Any]] = {}
        self.prev: dict[str, dict[str, Any]] = {}
        self.pids: dict[str, set[int]] = collections.defaultdict(set)
        self.outcomes: dict[tuple[str, str], str | None] = {}  # cell -> last failure

    def activate(self, name: str, *sim_flags: str) -> None:
        claim = {"namespace": "truth", "name": name, "uid": f"uid-{name}"}
        answer = self.agent.activate_sim(name, *sim_flags, claim_ref=claim)
        self.asked[name] = {"model_name": name, "artifact_url": f"huggingface://test/{name}",
                            "claim_ref": claim, "ipc_name": answer["ipc_name"],
                            "port": answer["port"], "kv_limit_requested_bytes": KV_LIMIT}

    def limit(self, name: str, limit: int = KV_LIMIT) -> None:
        self.agent.client.kv_limit(name, limit)
        self.asked[name]["kv_limit_requested_bytes"] = limit
        self.asked[name]["kv_capacity_bytes"] = limit  # in force once capped (`asked`)

    def remember(self) -> None:
        """Every engine's entry now: what the next column's ``kept`` refers to."""
        for entry in self.agent.client.snapshot()["models"]:
            self.prev[entry["model_name"]] = entry
            if entry["pid"] is not None:
                self.pids[entry["model_name"]].add(entry["pid"])

    def moment(self, name: str, since: float, cursor: int) -> Moment:
        client = self.agent.client
        self.truth.sample([a["ipc_name"] for a in self.asked.values()])
        before = client.snapshot()
        metrics = agent_metrics(self.agent.url)
        listed = client.models()["models"]
        entry = next((e for e in before["models"] if e["model_name"] == name), None)
        pid = entry["pid"] if entry else None
        truth = self.truth.rows(pid, self.asked[name]["ipc_name"])
        last_pid = pid if pid is not None else (self.prev.get(name) or {}).get("pid")
        truth["alive"] = [live(last_pid)]
        healthy, figures = engine_figures(self.asked[name]["port"]) if pid else (False, {})
        truth.update(figures)
        truth.update({"fresh " + k: v for k, v in figures.items()})
        truth["ready"] = [healthy]
        fresh_asked, fresh = time.time(), None
        if entry is not None:
            try:
                fresh = next((e for e in client.get(
                    f"/v1/runtime/snapshot?fresh=requests&model={name}")["models"]
                    if e["model_name"] == name), None)
            except AgentError as exc:  # stopped meanwhile: no such model now
                if exc.status != 404:
                    raise
        after = client.snapshot()
        return Moment(
            name=name, entry=entry,
            listed=next((e for e in listed if e["model_name"] == name), None),
            snaps=(before, after), metrics=metrics,
            events=client.events(cursor)["events"], since=since, now=time.time(),
            asked=self.asked[name], prev=self.prev.get(name),
            pids_before=set(self.pids[name]), truth=truth, health_ok=healthy,
            fresh=fresh, fresh_asked=fresh_asked, started=started(pid))

    def failures(self, column: str, m: Moment) -> dict[str, str]:
        found = {}
        for row, cells in self.table.items():
            why = check(row, cells[column], m)
            if why is not None:
                found[row] = why
        return found

    def column(self, column: str, name: str, since: float, cursor: int,
               settle_s: float = 10.0, still: Callable[[], bool] = lambda: True) -> None:
        """Wait until every cell of ``column`` holds for ``name``, then poll for ``WINDOW_S``
        (a transient phase: while ``still()``): every cell must hold at every poll."""
        deadline = time.monotonic() + settle_s
        wrong: dict[str, str] = {}
        pending = {row for (row, col) in PENDING if col == column}
        while True:
            m = self.moment(name, since, cursor)
            if not still():  # the phase ended during this poll: it may have seen the next one
                raise AssertionError(f"{column} ({name}) ended before a poll held: {wrong}")
            wrong = self.failures(column, m)
            if set(wrong) <= pending or column in PENDING_COLUMNS \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        held = dict(wrong)
        end = time.monotonic() + WINDOW_S
        polls = 1
        while time.monotonic() < end and still():
            m = self.moment(name, since, cursor)
            if not still():
                break  # (as above)
            for row, why in self.failures(column, m).items():
                held.setdefault(row, why)
            polls += 1
        for row in self.table:
            self.outcomes[(row, column)] = held.get(row)
        unexpected = {r: w for r, w in held.items() if r not in pending}
        if column in PENDING_COLUMNS:
            assert held, f"{column} holds now: remove it from PENDING_COLUMNS"
            unexpected = {}
        if os.environ.get("TRUTH_REPORT"):
            print(f"\n### {column} ({name}, {polls} polls)")
            for r, w in unexpected.items():
                print(f"   {r}: {w}")
            unexpected = {}
        assert not unexpected, f"{column} ({name}, {polls} polls): {unexpected}"
        if m.entry is not None:
            self.prev[name] = m.entry
            if m.entry["pid"] is not None:
                self.pids[name].add(m.entry["pid"])

    def during(self, column: str, name: str, call: Callable[[], Any],
               in_flight: Callable[[dict[str, Any]], bool]) -> tuple[float, int]:
        """Check ``column`` while ``call`` (made in the background) is in flight."""
        since, cursor = time.time(), self.cursor()
        caller = in_background(call)
        wait_entry(self.agent, name, in_flight, f"{column} in flight")
        self.column(column, name, since, cursor, still=caller.is_alive)
        caller.join(20)
        return since, cursor

    def cursor(self) -> int:
        return int(self.agent.client.events(0)["cursor"])


def in_background(call: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        try:
            call()
        except Exception:  # noqa: BLE001 - the agent may be killed under it
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_entry(agent: AgentProcess, name: str, pred: Callable[[dict[str, Any]], bool],
               what: str, timeout_s: float = 20) -> dict[str, Any]:
    snap = agent.wait_for(lambda s: any(e["model_name"] == name and pred(e) for e in s["models"]),
                          timeout_s=timeout_s, what=f"{name}: {what}", poll_s=0.03)
    return agent.model(snap, name)


def recorded(agent: AgentProcess, name: str) -> dict[str, Any]:
    """The engine's durable record as the next agent will read it."""
    for path in (agent.state_dir / "engines").glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("spec", {}).get("model_name") == name:
            return dict(record)
    return {}


def started(pid: int | None) -> float | None:
    """When process ``pid`` started (time.time()), None without one."""
    try:
        return psutil.Process(pid).create_time() if pid is not None else None
    except psutil.Error:
        return None


def kill_engine(agent: AgentProcess, name: str) -> int:
    pid = int(agent.model(agent.client.snapshot(), name)["pid"])
    psutil.Process(pid).kill()
    return pid


def test_every_cell_of_the_fields_by_phase_table_holds_on_a_real_agent(agent_factory) -> None:
    table = load_table(DOC)
    agent: AgentProcess = agent_factory(restart_delays="2,0.1,0.1,0.1,0.1",
                                        extra_args=["--gpu-sample-interval", str(SAMPLE_S)])
    walk = Walk(agent, table)

    # booting: the KV limit is asked before the engine has a segment
    since, cursor = time.time(), 0
    walk.activate("boot", "--sim-startup-seconds=4")
    walk.limit("boot")
    walk.column("booting", "boot", since, cursor,
                still=lambda: not agent.model(agent.client.snapshot(), "boot")["ready"])

    flags = {"s1": ["--sim-wake-seconds=3"], "stopper": ["--sim-stop-seconds=3"],
             "waker": ["--sim-wake-seconds=6"], "stopper2": ["--sim-stop-seconds=6"],
             "crash": ["--sim-sleep-seconds=4"]}  # its sleep: adopted mid-sleep
    names = ("awake", "s1", "s2", "crash", "doomed", "stopper", "waker", "crash2", "stopper2",
             "big")
    for name in names:
        walk.activate(name, *flags.get(name, []))
    for name in names:
        agent.wait_phase(name, "active")
        walk.limit(name, ABOVE_CAPACITY if name == "big" else KV_LIMIT)
    for _ in range(2):
        assert complete(walk.asked["awake"]["port"], "awake")[0] == 200
    walk.remember()

    walk.column("active", "awake", time.time() - 30, 0)
    walk.column("above capacity", "big", time.time() - 30, 0)
    cursor = walk.cursor()
    (agent.shm_dir / walk.asked["big"]["ipc_name"]).unlink()  # an operator's rm: it runs on
    walk.column("segment deleted", "big", time.time() - 30, cursor)

    since, cursor = time.time(), walk.cursor()
    agent.client.sleep("s1", 1)
    walk.column("sleeping-1", "s1", since, cursor)
    since, cursor = time.time(), walk.cursor()
    agent.client.sleep("s2", 2)
    walk.column("sleeping-2", "s2", since, cursor)

    since, cursor = walk.during("waking", "s1", lambda: agent.client.wake("s1"),
                                lambda e: e["operation"] == "wake")
    walk.column("woken", "s1", since, cursor)

    since, cursor = time.time(), walk.cursor()
    kill_engine(agent, "crash")
    wait_entry(agent, "crash", lambda e: e["phase"] == "restarting", "restarting")
    walk.column("restarting", "crash", since, cursor, settle_s=1.5,
                still=lambda: agent.model(agent.client.snapshot(), "crash")["pid"] is None)

    since, cursor = time.time(), walk.cursor()
    for count in range(1, 6):  # as AIBrix's runbook R3: kill each replacement once it serves
        kill_engine(agent, "doomed")
        wait_entry(agent, "doomed", lambda e: e["restart_count"] == count and e["ready"],
                   f"restart {count} serving")
    kill_engine(agent, "doomed")
    walk.column("failed", "doomed", since, cursor)

    walk.during("stopping", "stopper", lambda: agent.client.deactivate("stopper"),
                lambda e: e["phase"] == "stopping")

    # Everything the successor must take over, in flight at the SIGKILL. Their phases began
    # here, before the kill: a time the table asks of them may be as early as this.
    began = time.time()
    agent.client.sleep("s1", 1)
    agent.client.sleep("waker", 1)
    walk.activate("boot2", "--sim-startup-seconds=10")
    walk.limit("boot2")
    wait_entry(agent, "boot2", lambda e: e["phase"] == "booting" and e["pid"], "booting")
    in_background(lambda: agent.client.wake("waker"))
    wait_entry(agent, "waker", lambda e: e["operation"] == "wake", "wake in flight")
    in_background(lambda: agent.client.sleep("crash", 1))
    wait_entry(agent, "crash", lambda e: e["operation"] == "sleep", "sleep in flight")
    # in flight in the record comes before the call is sent: wait until the engine has it, so
    # that the successor has a landed sleep to see through (the wake above need not have
    # reached its engine yet, and is not waited for: seen here, it had not within 10 s)
    assert wait_until(lambda: agent.engine_said("Putting the engine to sleep", "crash"), 10)
    in_background(lambda: agent.client.deactivate("stopper2"))
    wait_entry(agent, "stopper2", lambda e: e["phase"] == "stopping", "stopping")
    kill_engine(agent, "crash2")
    wait_entry(agent, "crash2", lambda e: e["phase"] == "restarting", "restarting")
    # the restart is durable (the view says `restarting` a moment before the record does)
    assert wait_until(lambda: recorded(agent, "crash2").get("phase") == "restarting", 10)
    walk.remember()
    assert recorded(agent, "crash").get("operation"), "the sleep landed before the SIGKILL"
    new = restart_agent(agent_factory, agent)
    walk.agent = new
    # the sleep in flight frees the engine's weights when it lands: let the new agent see it
    # through before any column is polled, so that no node-wide figure is polled across it
    wait_entry(new, "crash", lambda e: e["phase"] == "sleeping" and e["operation"] is None,
               "the sleep in flight seen through")
    walk.column("adopted booting", "boot2", began, 0,
                still=lambda: not new.model(new.client.snapshot(), "boot2")["ready"])
    for column, name in (("adopted active", "awake"), ("adopted sleeping-1", "s1"),
                         ("adopted sleeping-2", "s2"), ("adopted waking", "waker"),
                         ("adopted mid-sleep", "crash"),
                         ("adopted restarting", "crash2"), ("adopted failed", "doomed"),
                         ("adopted stopping", "stopper2")):
        walk.column(column, name, began, 0)

    passing = sorted(cell for cell in PENDING if walk.outcomes.get(cell) is None)
    assert not passing, f"cells in PENDING now hold (remove them): {passing}"
    unchecked = sorted((row, col) for row in table for col in COLUMNS
                       if (row, col) not in walk.outcomes)
    assert not [c for c in PENDING if c[0] not in table], "PENDING names a row the doc lacks"
    assert not unchecked, f"cells the walk did not check: {unchecked}"


def _bare_moment(entry: dict[str, Any]) -> Moment:
    snap = {"models": [entry], "observed_at": "", "accelerators": [], "cached_artifacts": []}
    return Moment(name="m", entry=entry, listed=None, snaps=(snap, snap), metrics=[], events=[],
                  since=0.0, now=0.0, asked={}, prev=None, pids_before=set())


def test_a_doc_row_the_walk_has_no_check_for_fails() -> None:
    with pytest.raises(KeyError, match="no check"):
        check("a_field_nobody_reports", "null", _bare_moment({"model_name": "m"}))
    with pytest.raises(KeyError, match="no count check"):
        check("aibrix:modelclaim_gpu_samples_total", "counted", _bare_moment({"model_name": "m"}))


def test_a_cell_word_outside_the_vocabulary_fails() -> None:
    moment = _bare_moment({"model_name": "m", "phase": "active", "pid": 1})
    assert check("phase", "probably", moment) is not None
    assert check("events", "Woken", moment) is not None
    assert check("phase", '"active"', moment) is None
    assert check("pid", "measured", moment) is not None  # a row with no truth measures nothing
