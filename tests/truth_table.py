"""The "Fields by phase" table of docs/fields.md, parsed, and what each of its cells checks.

The table is the single source: ``tests/test_truth_table.py`` walks a real agent through every
column and calls ``check`` on every cell at every poll. Each cell's word (the vocabulary at the
top of that section) is a predicate over one ``Moment``: what the agent answered (snapshot,
model list, ``/metrics``, events) and what is true of the engine then (its process, its report
to the simulated GPU, its kvcached segment, its own ``/metrics``). A row this module has no
check for, or a word it does not know, is a failure: no cell is silent.
"""

from __future__ import annotations

import collections
import json
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from markdown_it import MarkdownIt
from prometheus_client.parser import text_string_to_metric_families

from runtime_agent.kv.segment import read_segment

SECTION = "Fields by phase"
COLUMNS = ("booting", "active", "above capacity", "segment deleted", "sleeping-1", "sleeping-2",
           "waking", "woken", "restarting", "failed", "stopping", "adopted booting", "adopted active",
           "adopted sleeping-1", "adopted sleeping-2", "adopted waking", "adopted mid-sleep",
           "adopted restarting", "adopted failed", "adopted stopping")
P = "aibrix:modelclaim_"
GIB = 1024**3
CARD_BYTES = 80 * GIB  # --simulate-gpus default: 1x80GiB
KV_CAPACITY = 2 * GIB  # the simulator's default --sim-kv-capacity-bytes
HISTORY_S = 1.5  # a figure may lag the truth by a few samples on a loaded machine, no more


def load_table(path: Path, section: str = SECTION, columns: tuple[str, ...] = COLUMNS
               ) -> dict[str, dict[str, str]]:
    """Row key -> {column: cell} of the table headed ``field`` under ``## <section>``."""
    tokens = MarkdownIt("commonmark").enable("table").parse(path.read_text())
    start = next(i for i, t in enumerate(tokens) if t.type == "heading_open" and t.tag == "h2"
                 and tokens[i + 1].content.strip() == section)
    rows: list[list[str]] = []
    for token in tokens[start:]:
        if token.type == "table_open":
            rows = []
        elif token.type == "table_close" and rows and rows[0][0] == "field" \
                and rows[0][1:] != ["meaning"]:  # a section's table of meanings comes first
            break
        elif token.type == "tr_open":
            rows.append([])
        elif token.type == "inline" and rows:
            rows[-1].append(token.content.replace("`", "").strip())
    header, *body = rows
    if tuple(header[1:]) != columns:
        raise AssertionError(f"columns {header[1:]} are not {columns}")
    table: dict[str, dict[str, str]] = {}
    for cells in body:
        if cells[0] in table:
            raise AssertionError(f"row {cells[0]!r} appears twice")
        table[cells[0]] = dict(zip(columns, cells[1:], strict=True))
    return table


@dataclass
class Moment:
    """One poll of one engine: the agent's answers and the truth read around them."""

    name: str
    entry: dict[str, Any] | None  # the snapshot's model, None when absent
    listed: dict[str, Any] | None  # GET /v1/runtime/models
    snaps: tuple[dict[str, Any], dict[str, Any]]  # snapshots before and after /metrics
    metrics: list[tuple[str, dict[str, str], float]]
    events: list[dict[str, Any]]  # the feed since this column's phase was brought about
    since: float  # when the walk brought the phase about (time.time())
    now: float
    asked: dict[str, Any]  # what the activation asked and answered, and the KV limit
    prev: dict[str, Any] | None  # this engine's snapshot entry at its previous check
    pids_before: set[int]  # the pids this engine had before this column
    truth: dict[str, list[Any]] = field(default_factory=dict)  # row -> values true lately
    health_ok: bool = False  # the engine's port answers /health 200 now
    fresh: dict[str, Any] | None = None  # its entry of ``?fresh=requests&model=``, None: absent
    fresh_asked: float = 0.0  # when that fresh look was asked for (time.time())
    started: float | None = None  # when the engine's current process started (time.time())


def _entry_value(m: Moment, key: str) -> Any:
    if key == "kv_segment.present":
        return (m.entry or {}).get("kv_segment", {}).get("present")
    return (m.entry or {})[key]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _time_ok(value: Any, m: Moment, slack_s: float = 0.5) -> bool:
    return _time_between(value, m.since, m.now, slack_s)


def _time_between(value: Any, start: float, end: float, slack_s: float = 0.05) -> bool:
    if not isinstance(value, str):
        return False
    at = datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return start - slack_s <= at <= end + slack_s


def live(pid: Any) -> bool:
    """Whether ``pid`` is a running process (a zombie holds nothing and serves nothing)."""
    try:
        return _is_int(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def check_value(row: str, word: str, value: Any, present: bool, m: Moment) -> str | None:
    """None when ``value`` (of ``row`` at moment ``m``) is what ``word`` says; else why not."""
    truth = m.truth.get(row)
    if word.startswith("="):
        other = word[1:]
        wants = [s_entry(s, m.name).get(other) for s in m.snaps]
        if not present:
            return None if None in wants else f"absent, snapshot {other} {wants}"
        return None if value in wants else f"{value!r}, snapshot {other} {wants}"
    if word == "absent":
        return None if not present else f"present ({value!r})"
    if not present:
        return "absent"
    if word == "null":
        return None if value is None else f"{value!r}, not null"
    if word == "measured":
        if not _is_int(value):
            return f"{value!r} is no measured figure"
        if truth is None:
            return "the row has no truth to measure against"
        return None if value in truth else f"{value} but the truth was {sorted(set(truth))}"
    if word == "asked":
        want = m.asked[row]
        return None if value == want else f"{value!r}, asked {want!r}"
    if word == "kept":
        if m.prev is None:
            return "no previous check to keep a value from"
        want = m.prev.get(row) if row != "kv_segment.present" else None
        if row == "last_exit" and isinstance(value, str) and isinstance(want, str) \
                and value.startswith(want + "\n"):
            return None  # the exit's log tail reached the disk before the view: kept, and more
        return None if value == want else f"{value!r}, before {want!r}"
    if word == "live":
        return None if live(value) else f"{value!r} is no live process"
    if word == "new":
        return (None if live(value) and value not in m.pids_before
                else f"{value!r} is not a new live process (had {sorted(m.pids_before)})")
    if word == "text":
        return None if isinstance(value, str) and value.strip() else f"{value!r} is no text"
    if word == "time":
        return None if _time_ok(value, m) else f"{value!r} is not a time in this phase"
    if word == "peak":
        floor = max([*(truth or []), 0])
        return (None if _is_int(value) and value >= floor
                else f"{value!r} is below the {floor} bytes the engine held")
    if word == "read":  # a read of the engine's current process, never an older one's
        return (None if m.started is not None and _time_between(value, m.started, m.now)
                else f"{value!r} is no read of the process started at {m.started}")
    if word == "now":
        return (None if _time_between(value, m.fresh_asked, m.now)
                else f"{value!r} is not within the call asked at {m.fresh_asked}")
    if word == ">0":
        return None if isinstance(value, (int, float)) and value > 0 else f"{value!r}, not > 0"
    try:
        literal = json.loads(word)
    except json.JSONDecodeError:
        return f"the word {word!r} is not in the vocabulary"
    if value != literal or type(value) is not type(literal) and not (
            isinstance(value, float) and _is_int(literal)):
        return f"{value!r}, not {word}"
    if truth is not None and isinstance(literal, bool) and (literal or row != "ready") \
            and literal not in truth:
        return f"{value!r} but the truth was {truth}"
    return None


def s_entry(snap: dict[str, Any], name: str) -> dict[str, Any]:
    return next((e for e in snap["models"] if e["model_name"] == name), {})


class Truth:
    """What is true of the engines, sampled at every poll and kept for ``HISTORY_S``."""

    def __init__(self, state_dir: Path, shm_dir: Path) -> None:
        self.channel = state_dir / "sim-gpu"
        self.shm_dir = shm_dir
        self.samples: collections.deque[tuple[float, dict[int, int], dict[str, Any]]] = \
            collections.deque()
        self.peaks: dict[int, int] = {}

    def sample(self, ipc_names: list[str]) -> None:
        reports: dict[int, int] = {}
        for path in self.channel.glob("*.json"):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if psutil.pid_exists(data["pid"]):
                reports[data["pid"]] = (data["weights_bytes"] + data["kv_bytes"]
                                        + data["context_bytes"])
        for pid, held in reports.items():
            self.peaks[pid] = max(self.peaks.get(pid, 0), held)
        segments = {ipc: read_segment(ipc, self.shm_dir) for ipc in ipc_names}
        now = time.monotonic()
        self.samples.append((now, reports, segments))
        while self.samples and self.samples[0][0] < now - HISTORY_S:
            self.samples.popleft()

    def rows(self, pid: int | None, ipc: str) -> dict[str, list[Any]]:
        """Row -> the values that were true lately (any one of them may be reported)."""
        held = [r.get(pid, 0) for _, r, _ in self.samples] if pid is not None else []
        segs = [s[ipc] for _, _, s in self.samples]
        live = [s for s in segs if s is not None]
        return {
            "hbm_bytes": held, "sleeping_footprint_bytes": held,
            "hbm_peak_bytes": [self.peaks.get(pid, 0)] if pid is not None else [],
            "accelerators[].hbm_free_bytes": [CARD_BYTES - sum(r.values())
                                              for _, r, _ in self.samples],
            "accelerators[].hbm_total_bytes": [CARD_BYTES],
            "kv_used_bytes": [s.mapped for s in live],
            "kv_capacity_bytes": [s.total_size for s in live],
            "kv_total_bytes": [s.total_size for s in live],
            "kv_limit_applied_bytes": [s.total_size for s in live],
            "kv_startup_capacity_bytes": [KV_CAPACITY],
            "kv_segment.present": [s is not None for s in segs],
        }


def engine_figures(port: int) -> tuple[bool, dict[str, list[Any]]]:
    """The engine's own /health and request figures, read directly."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            healthy = resp.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return False, {}
    sums: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sums[s.name] += s.value
    return healthy, {"requests_running": [int(sums["vllm:num_requests_running"])],
                     "requests_waiting": [int(sums["vllm:num_requests_waiting"])],
                     "request_success_total": [int(sums["vllm:request_success_total"])]}


def agent_metrics(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the agent's ``/metrics`` at ``url``: name, labels, value."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


_METRIC = re.compile(r"^(?P<name>[a-z_:]+)(?:\{(?P<labels>[^}]*)\})?$")
# rows of engine fields read from the model list, and the node's fields
_LISTED = re.compile(r"^list (?P<key>[a-z_]+)$")
NODE_ROWS: dict[str, Callable[[Moment], Any]] = {
    "observed_at": lambda m: m.snaps[0]["observed_at"],
    "accelerators[].id": lambda m: m.snaps[0]["accelerators"][0]["id"],
    "accelerators[].hbm_total_bytes": lambda m: m.snaps[0]["accelerators"][0]["hbm_total_bytes"],
    "accelerators[].hbm_free_bytes": lambda m: m.snaps[0]["accelerators"][0]["hbm_free_bytes"],
    "cached_artifacts": lambda m: m.snaps[0]["cached_artifacts"],
}
# fields of another answer than the plain snapshot's: rows that must read `absent` there
OTHER_ANSWERS = frozenset({"request_figures_fresh"})
_FRESH = "fresh "  # rows read from ``GET /v1/runtime/snapshot?fresh=requests&model=NAME``


def check(row: str, word: str, m: Moment) -> str | None:
    """Check one cell; a row with no check here raises (the doc has a silent row)."""
    if row in NODE_ROWS:
        return check_value(row, word, NODE_ROWS[row](m), True, m)
    if row == "events":
        return _check_events(word, m)
    if row == "present":
        return check_value(row, word, m.entry is not None, True, m)
    if row.startswith(_FRESH):
        key = row.removeprefix(_FRESH)
        present = m.fresh is not None and key in m.fresh
        return check_value(row, word, (m.fresh or {}).get(key), present, m)
    if row in OTHER_ANSWERS:
        present = m.entry is not None and row in m.entry
        return check_value(row, word, (m.entry or {}).get(row), present, m)
    if (listed := _LISTED.match(row)) is not None:
        key = listed["key"]
        present = m.listed is not None and key in m.listed
        return check_value(key, word, (m.listed or {}).get(key), present, m)
    if (metric := _METRIC.match(row)) is not None and metric["name"].startswith(P):
        return _check_metric(metric["name"], metric["labels"] or "", word, m)
    key = row
    if m.entry is None:
        return None if word == "absent" else "the engine is not in the snapshot"
    if key != "kv_segment.present" and key not in m.entry:
        raise KeyError(f"row {row!r} names no field of the snapshot and has no check")
    return check_value(key, word, _entry_value(m, key), True, m)


def _check_events(word: str, m: Moment) -> str | None:
    if not word.startswith("event:"):
        return f"the word {word!r} is not in the vocabulary of the events row"
    want = word.removeprefix("event:")
    mine = [(e["reason"], e["to"]) for e in m.events if e["model"] == m.name]
    if want == "none":
        return None if not mine else f"events {mine}"
    return None if any(want in pair for pair in mine) else f"no {want} event in {mine}"


def _check_metric(name: str, template: str, word: str, m: Moment) -> str | None:
    fixed: dict[str, str] = {}
    free: list[str] = []
    for part in filter(None, (p.strip() for p in template.split(","))):
        key, eq, label = part.partition("=")
        if eq:
            fixed[key] = label.strip('"')
        else:
            free.append(key)
    if word == "counted":
        return _check_counted(name, free, m)
    if "model" in free:
        fixed["model"] = m.name
    values = [v for n, labels, v in m.metrics
              if n == name and all(labels.get(k) == val for k, val in fixed.items())]
    if len(values) > 1:
        return f"{len(values)} series match"
    if word.startswith("="):
        field_name = word[1:]
        wants = [s_entry(s, m.name).get(field_name) for s in m.snaps]
        if not values:
            return None if None in wants else f"absent, snapshot {field_name} {wants}"
        return None if values[0] in wants else f"{values[0]}, snapshot {field_name} {wants}"
    if not values:
        return check_value(name, word, None, False, m)
    number: float = int(values[0]) if values[0] == int(values[0]) else values[0]
    return check_value(name, word, number, True, m)


def _check_counted(name: str, free: list[str], m: Moment) -> str | None:
    """An agent-wide gauge: within what the snapshots before and after it counted."""
    if name == P + "models_resident":
        counts = [sum(1 for e in s["models"] if e["alive"]) for s in m.snaps]
        got = [v for n, _, v in m.metrics if n == name]
        return None if got and min(counts) <= got[0] <= max(counts) else f"{got} not in {counts}"
    if name == P + "engine_state" and free == ["phase"]:
        for n, labels, v in m.metrics:
            if n != name:
                continue
            counts = [sum(1 for e in s["models"] if e["phase"] == labels["phase"])
                      for s in m.snaps]
            if not min(counts) <= v <= max(counts):
                return f"{labels['phase']}: {v} not in {counts}"
        return None
    raise KeyError(f"no count check for {name}")
