"""What the live view (``runtime-agent top``) draws, as plain data from a snapshot and events.

Pure functions, tested without a terminal: each card's memory as a bar split by engine (an
awake engine's HBM with its KV cache in use marked apart, a sleeping engine's footprint, memory
no engine accounts for, free memory), and one row per engine with the figures an operator
watches (phase, requests, restarts, KV used of its limit, its last event).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime_agent.console.output import number, size
from runtime_agent.console.tables import engine_label

STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")
KV_CHAR, HBM_CHAR, ASLEEP_CHAR, OTHER_CHAR, FREE_CHAR = "▓", "█", "░", "▒", "·"
COLUMNS = ("MODEL", "ENGINE", "PHASE", "READY", "RUN", "WAIT", "RESTARTS", "HBM", "KV USED/LIMIT",
           "LAST EVENT")


@dataclass(frozen=True)
class Segment:
    """A stretch of one card's bar: ``label`` holds ``bytes`` drawn with ``char`` in ``style``."""

    label: str
    bytes: int
    char: str
    style: str


def style_of(models: list[dict[str, Any]], name: str) -> str:
    names = sorted(m["model_name"] for m in models)
    return STYLES[names.index(name) % len(STYLES)] if name in names else "white"


def card_segments(gpu: dict[str, Any], models: list[dict[str, Any]]) -> list[Segment]:
    """One card's memory, engine by engine (an engine on N cards counts 1/N of its HBM here)."""
    index = gpu["index"]
    out: list[Segment] = []
    for m in sorted(models, key=lambda m: m["model_name"]):
        devices = m.get("devices") or []
        if index not in devices:
            continue
        share = len(devices)
        style = style_of(models, m["model_name"])
        if m["phase"] == "sleeping":
            asleep = (m.get("sleeping_footprint_bytes") or m.get("hbm_bytes") or 0) // share
            out.append(Segment(m["model_name"], asleep, ASLEEP_CHAR, style))
            continue
        hbm = (m.get("hbm_bytes") or 0) // share
        kv = min(hbm, (m.get("kv_used_bytes") or 0) // share)
        out.append(Segment(m["model_name"] + " KV", kv, KV_CHAR, style))
        out.append(Segment(m["model_name"], hbm - kv, HBM_CHAR, style))
    accounted = sum(s.bytes for s in out)
    used = gpu.get("hbm_used_bytes") or 0
    if used > accounted:
        out.append(Segment("other", used - accounted, OTHER_CHAR, "bright_black"))
    free = max(0, (gpu.get("hbm_total_bytes") or 0) - max(used, accounted))
    out.append(Segment("free", free, FREE_CHAR, "bright_black"))
    return out


def bar(segments: list[Segment], width: int) -> list[tuple[str, str]]:
    """``(text, style)`` runs filling ``width`` cells in proportion; a non-empty segment gets at
    least one cell (taken from the largest), so no engine disappears from a card."""
    total = sum(s.bytes for s in segments)
    if total <= 0 or width <= 0:
        return [(FREE_CHAR * max(0, width), "bright_black")]
    cells = [int(width * s.bytes / total) for s in segments]
    for i, s in enumerate(segments):
        if s.bytes > 0 and cells[i] == 0:
            cells[i] = 1
    while sum(cells) > width:
        cells[cells.index(max(cells))] -= 1
    while sum(cells) < width:
        big = max(range(len(segments)), key=lambda i: segments[i].bytes)
        cells[big] += 1
    return [(s.char * n, s.style) for s, n in zip(segments, cells, strict=True) if n > 0]


def card_title(gpu: dict[str, Any], simulated: bool) -> str:
    return (f"GPU {gpu['index']} {gpu.get('name', '')}{' (simulated)' if simulated else ''}: "
            f"{size(gpu.get('hbm_used_bytes'))} used of {size(gpu.get('hbm_total_bytes'))}, "
            f"room for new engines {size(gpu.get('hbm_room_bytes'))}")


def legend(segments: list[Segment]) -> list[tuple[str, str]]:
    """The named segments of a card, with their sizes (the bar's key)."""
    return [(f"{s.char} {s.label} {size(s.bytes)}  ", s.style) for s in segments
            if s.bytes > 0 and s.label != "free"]


def kv_figure(m: dict[str, Any]) -> str:
    used, limit = m.get("kv_used_bytes"), m.get("kv_limit_applied_bytes")
    if used is None and limit is None:
        return "-"
    text = f"{size(used)}/{size(limit)}"
    return text + (" cap" if m.get("kv_limit_capped_by") else "")


def engine_rows(snapshot: dict[str, Any], last_events: dict[str, str]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for m in sorted(snapshot.get("models", []), key=lambda m: m["model_name"]):
        name = m["model_name"]
        rows.append((name, engine_label(m), m["phase"], "yes" if m.get("ready") else "no",
                     number(m.get("requests_running")), number(m.get("requests_waiting")),
                     str(m.get("restart_count", 0)), size(m.get("hbm_bytes")), kv_figure(m),
                     last_events.get(name, "")))
    return rows


def event_summary(event: dict[str, Any]) -> str:
    """An event as the LAST EVENT column shows it."""
    first = (event.get("message") or "").splitlines()[:1]
    move = event["to"] if event["from"] == event["to"] else f"{event['from']}->{event['to']}"
    return f"{event['reason']}: {move}" + (f" ({first[0][:40]})" if first else "")


def headline(snapshot: dict[str, Any], url: str) -> str:
    agent = snapshot.get("agent", {})
    engines = "SIMULATED engines" if agent.get("simulated_engines") else "real engines"
    gpu = snapshot.get("node", {}).get("gpu_backend", "?")
    memory = "SIMULATED GPU memory" if gpu == "simulated" else f"GPU memory from {gpu}"
    return (f"runtime-agent {agent.get('version', '?')} at {url}: {engines}, {memory}; "
            f"{len(snapshot.get('models', []))} engine(s)")
