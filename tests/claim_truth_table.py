"""The "Claims by situation" and "ModelRoutes by situation" tables of docs/fields.md, and what
each of their cells checks.

As ``tests/truth_table.py`` does for an engine's fields, the tables are the single source:
``tests/test_claim_truth_table.py`` brings a real reconciler (and its door) with a real agent
into every column and calls ``claim_check`` or ``route_check`` on every cell at every poll. A
cell's word is a predicate over one moment: what the reconciler answered (the claim's JSON, its
state directory, ``/v1/modelroutes``, ``/metrics``, the door's answer) and what is true then
(the agent's engine, what that engine reported to the simulated GPU and its kvcached segment,
which engine served a call). A row with no check here, or a word outside the vocabulary, fails.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reconciler.footprints import book_key

CLAIM_SECTION = "Claims by situation"
CLAIM_COLUMNS = ("declared", "neverSleep", "sleepAfterSeconds", "invalid lifecycle",
                 "estimated", "measured", "invalid edit", "unmeasured")
ROUTE_SECTION = "ModelRoutes by situation"
ROUTE_COLUMNS = ("matched", "unmatched", "exact name", "streamed")
MiB = 1 << 20
ENGINE_PHASES = {"active": "Active", "sleeping": "Sleeping", "activating": "Activating",
                 "booting": "Activating"}
_IDLE = re.compile(r"^idle for (\d+) s")
_MEASURED = re.compile(r"^measured on (\S+): peak HBM (\d+) bytes less (\d+) of KV cache in use,"
                       r" per GPU; KV floor ")


@dataclass
class Asked:
    """What the walk wrote for one claim."""

    artifact: str
    args: dict[str, str]
    footprint: int | None = None  # declared bytes (None: no perGPU)
    kv_floor: int | None = None
    estimate: tuple[int, int] | None = None  # contract.footprint's (footprint, kv floor)
    own_idle: float | None = None  # the annotation's sleepAfterSeconds
    pool_idle: float = 0.0


@dataclass
class ClaimMoment:
    """One poll of one claim: the reconciler's answers and the truth read around them."""

    doc: dict[str, Any] | None  # GET /v1/claims/default/NAME; None: 404
    book: list[dict[str, Any]]  # <state-dir>/observed-footprints.json rows
    engine: dict[str, Any] | None  # the agent's snapshot entry of the claim's model
    asked: Asked
    truth: dict[str, list[Any]] = field(default_factory=dict)  # hbm_peak_bytes, kv_used_bytes


def _literal(word: str, value: Any, present: bool) -> str | None:
    if word == "absent":
        return None if not present else f"present ({value!r})"
    if not present:
        return "absent"
    try:
        want = json.loads(word)
    except json.JSONDecodeError:
        return f"the word {word!r} is not in the vocabulary"
    return None if value == want and type(value) is type(want) else f"{value!r}, not {word}"


def _condition(doc: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    conds = (doc or {}).get("status", {}).get("conditions", [])
    return next((c for c in conds if c["type"] == kind), None)


def _events(m: ClaimMoment, reason: str) -> list[dict[str, Any]]:
    return [e for e in (m.doc or {}).get("events", []) if e["reason"] == reason]


def _per_gpu(m: ClaimMoment) -> dict[str, Any]:
    return dict((m.doc or {}).get("spec", {}).get("perGPU") or {})


def _measured_ok(footprint: Any, m: ClaimMoment) -> bool:
    """``footprint`` is (P - K) rounded up to a MiB for a true peak P and a true K."""
    return any(footprint == -(-(p - k) // MiB) * MiB
               for p in m.truth.get("hbm_peak_bytes", []) for k in m.truth.get("kv_used_bytes", []))


def _source(m: ClaimMoment) -> tuple[str, int, int] | None:
    found = _MEASURED.match(str(_per_gpu(m).get("estimated", "")))
    return (found[1], int(found[2]), int(found[3])) if found else None


def _phase(word: str, m: ClaimMoment) -> str | None:
    value = (m.doc or {}).get("status", {}).get("phase")
    wrong = _literal(word, value, m.doc is not None)
    if wrong is None and m.engine is not None and word != "absent" \
            and ENGINE_PHASES.get(m.engine["phase"]) != json.loads(word):
        return f"{value} but the engine is {m.engine['phase']}"
    return wrong


def _conditioned(kind: str) -> Callable[[str, ClaimMoment], str | None]:
    """The check of condition ``kind``'s cells: its status and reason."""
    def check(word: str, m: ClaimMoment) -> str | None:
        cond = _condition(m.doc, kind)
        return _literal(word, cond and f"{cond['status']} {cond['reason']}", cond is not None)
    return check


def _warned(reason: str, kind: str) -> Callable[[str, ClaimMoment], str | None]:
    """The check of event ``reason``'s cells: ``warning`` is a Warning whose message is
    condition ``kind``'s."""
    def check(word: str, m: ClaimMoment) -> str | None:
        found = _events(m, reason)
        if word != "warning":
            return _literal(word, found, bool(found))
        cond = _condition(m.doc, kind)
        ok = [e for e in found
              if e["type"] == "Warning" and cond and e["message"] == cond["message"]]
        return None if ok else f"no Warning event with the condition's message in {found}"
    return check


def _slept(word: str, m: ClaimMoment) -> str | None:
    found = [int(x[1]) for e in _events(m, "Sleeping") if (x := _IDLE.match(e["message"]))]
    if word == "absent" or not found:
        return _literal(word, found, bool(found))
    low, high = {"own": (m.asked.own_idle, m.asked.pool_idle),
                 "pool": (m.asked.pool_idle, float("inf"))}.get(word, (None, 0.0))
    if low is None:
        return f"the word {word!r} is not in the vocabulary"
    return None if all(low <= n < high for n in found) else f"idle for {found} s, not in " \
                                                          f"[{low}, {high})"


def _figure(key: str, declared: Callable[[Asked], int | None], index: int
            ) -> Callable[[str, ClaimMoment], str | None]:
    def check(word: str, m: ClaimMoment) -> str | None:
        shown = _per_gpu(m)
        value, present = shown.get(key), key in shown
        if word == "declared":
            want = declared(m.asked)
        elif word == "estimate":
            want = m.asked.estimate[index] if m.asked.estimate else None
        elif word == "measured":
            return None if present and _measured_ok(value, m) else \
                f"{value!r} is no measured peak less KV used ({m.truth})"
        else:
            return _literal(word, value, present)
        return None if present and value == want else f"{value!r}, want {want!r}"
    return check


def _estimated(word: str, m: ClaimMoment) -> str | None:
    shown = _per_gpu(m)
    value, present = shown.get("estimated"), "estimated" in shown
    if word == "estimate":
        ok = isinstance(value, str) and value.startswith(
            f"estimated from {m.asked.artifact}: weights ") and "; KV floor " in value
        return None if ok else f"{value!r} is no estimate of {m.asked.artifact}"
    if word == "measured":
        source = _source(m)
        instances = (m.doc or {}).get("status", {}).get("instances") or [{}]
        if source is None:
            return f"{value!r} says no measurement"
        agent, peak, kv = source
        ok = (agent == instances[0].get("agent") and peak in m.truth.get("hbm_peak_bytes", [])
              and kv in m.truth.get("kv_used_bytes", [])
              and shown.get("maximumFootprint") == -(-(peak - kv) // MiB) * MiB)
        return None if ok else f"{value!r} is not the measurement shown ({shown}, {m.truth})"
    return _literal(word, value, present)


def _book(word: str, m: ClaimMoment) -> str | None:
    key = json.loads(book_key(m.asked.artifact, m.asked.args))
    rows = [r for r in m.book if r.get("key") == key]
    if word != "measured" or not rows:
        return _literal(word, rows, bool(rows))
    (row,) = rows
    source = _source(m)
    want = (_per_gpu(m).get("maximumFootprint"), *(source or ("?", 0, 0)))
    got = (row["footprint"], row["agent"], row["peak"], row["kv_used"])
    return None if got == want else f"{got}, the status says {want}"


def _ready(word: str, m: ClaimMoment) -> str | None:
    """``readyReplicas``: the number, and for a one-replica claim 1 exactly while Active."""
    status = (m.doc or {}).get("status", {})
    value = status.get("readyReplicas")
    wrong = _literal(word, value, "readyReplicas" in status)
    if wrong is None and word != "absent" and value != (status.get("phase") == "Active"):
        return f"{value} ready, but the claim is {status.get('phase')}"
    return wrong


def _indexes(word: str, m: ClaimMoment) -> str | None:
    """The ``index`` of each entry of ``status.instances`` (absent: no entry has one)."""
    found = [i["index"] for i in (m.doc or {}).get("status", {}).get("instances") or ()
             if "index" in i]
    return _literal(word, found, bool(found))


CLAIM_ROWS: dict[str, Callable[[str, ClaimMoment], str | None]] = {
    "status.phase": _phase,
    "status.readyReplicas": _ready,
    "status.instances[].index": _indexes,
    "condition Scheduled": _conditioned("Scheduled"),
    "LifecycleApplied": _conditioned("LifecycleApplied"),
    "event InvalidLifecycle": _warned("InvalidLifecycle", "LifecycleApplied"),
    "condition SpecApplied": _conditioned("SpecApplied"),
    "event InvalidSpec": _warned("InvalidSpec", "SpecApplied"),
    "event Sleeping": _slept,
    "spec.perGPU.maximumFootprint": _figure("maximumFootprint", lambda a: a.footprint, 0),
    "spec.perGPU.kvFloor": _figure("kvFloor", lambda a: a.kv_floor, 1),
    "spec.perGPU.estimated": _estimated,
    "observed-footprints.json": _book,
}


def claim_check(row: str, word: str, m: ClaimMoment) -> str | None:
    """Check one cell of the claims table; a row with no check raises."""
    if row not in CLAIM_ROWS:
        raise KeyError(f"row {row!r} of {CLAIM_SECTION!r} has no check")
    return CLAIM_ROWS[row](word, m)


@dataclass
class RouteMoment:
    """One poll of one route column: the reconciler's answers and who served the call."""

    name: str  # the name the call asked for
    item: dict[str, Any] | None  # its /v1/modelroutes item
    status: int  # the door's answer to the column's call
    headers: dict[str, str]  # that answer's headers, lower-cased
    metrics: list[tuple[str, dict[str, str], float]]  # the reconciler's /metrics
    matching: list[str]  # claims (namespace/name) the walk labelled to match
    served: dict[str, str]  # x-route-claim/-model/-agent of the engine that served, if any
    warm_before: bool  # the chosen claim was Active just before the call
    calls: dict[tuple[str, str], int]  # (kind, model) -> calls the walk made through the route
    tokens: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, model) -> the
    # engines' usage of every call the walk made through the door, so far
    usage: dict[str, int] | None = None  # the engine's usage of the column's call (None: none)
    access: dict[str, Any] | None = None  # the door's access line of the column's call


def _header(key: str) -> Callable[[str, RouteMoment], str | None]:
    def check(word: str, m: RouteMoment) -> str | None:
        value, present = m.headers.get(key), key in m.headers
        if word == "asked":
            return None if value == m.name else f"{value!r}, asked {m.name!r}"
        if word == "served":
            want = m.served.get(key)
            return None if present and value == want else f"{value!r}, served by {want!r}"
        wrong = _literal(word, value, present)
        if wrong is None and word == '"warm"' and not m.warm_before:
            return "warm, but the claim was not Active before the call"
        return wrong
    return check


def _candidates(word: str, m: RouteMoment) -> str | None:
    names = [c["claim"] for c in m.item["candidates"]] if m.item else None
    if word == "matching":
        return None if names == m.matching else f"{names}, labelled to match {m.matching}"
    return _literal(word, names, m.item is not None)


def _failed_scheduling(word: str, m: RouteMoment) -> str | None:
    conds = [c for c in (m.item or {}).get("conditions", []) if c["type"] == "FailedScheduling"]
    return _literal(word, conds and f"{conds[0]['status']} {conds[0]['reason']}", bool(conds))


def _choices(word: str, m: RouteMoment) -> str | None:
    series = {(labels["kind"], labels["model"]): int(v) for n, labels, v in m.metrics
              if n == "aibrix:door_route_choices_total" and labels.get("route") == m.name}
    if word == "counted":
        return None if series and series == m.calls else f"{series}, the walk made {m.calls}"
    return _literal(word, series, bool(series))


def _tokens(word: str, m: RouteMoment) -> str | None:
    series = {(labels["kind"], labels["model"]): int(v) for n, labels, v in m.metrics
              if n == "aibrix:door_tokens_total" and v}
    if word == "counted":
        want = {k: v for k, v in m.tokens.items() if v}
        return None if series == want else f"{series}, the engines' usage says {want}"
    return _literal(word, series, bool(series))


def _access(key: str) -> Callable[[str, RouteMoment], str | None]:
    def check(word: str, m: RouteMoment) -> str | None:
        value, present = (m.access or {}).get(key), m.access is not None and key in m.access
        if word == "usage":
            want = (m.usage or {}).get(key)
            return None if present and want is not None and value == want else \
                f"{value!r}, the engine's usage says {want!r}"
        return _literal(word, value, present)
    return check


ROUTE_ROWS: dict[str, Callable[[str, RouteMoment], str | None]] = {
    "modelroutes candidates": _candidates,
    "modelroutes FailedScheduling": _failed_scheduling,
    "door status": lambda word, m: _literal(word, m.status, True),
    "x-route": _header("x-route"),
    "x-route-claim": _header("x-route-claim"),
    "x-route-model": _header("x-route-model"),
    "x-route-agent": _header("x-route-agent"),
    "x-route-choice": _header("x-route-choice"),
    "aibrix:door_route_choices_total{route,kind,model}": _choices,
    "aibrix:door_tokens_total{model,kind}": _tokens,
    "access prompt_tokens": _access("prompt_tokens"),
    "access completion_tokens": _access("completion_tokens"),
}


def route_check(row: str, word: str, m: RouteMoment) -> str | None:
    """Check one cell of the routes table; a row with no check raises."""
    if row not in ROUTE_ROWS:
        raise KeyError(f"row {row!r} of {ROUTE_SECTION!r} has no check")
    return ROUTE_ROWS[row](word, m)
