"""The snapshot as people read it: one line per engine, then the cards, then what the marks mean.

Every figure has one meaning, the one in ``docs/fields.md``; a figure that could mislead says
why next to it: a KV limit the engine's own capacity caps, a simulated engine, an engine that
restarted and is healthy again (its last exit is history, not an error).
"""

from __future__ import annotations

from typing import Any

from runtime_agent.console.output import columns, number, size

SIM_MARK = " (sim)"
CAP_NOTES = {
    "engine_kv_capacity": "the engine created its KV cache with less than the limit asked "
                          "(KV CAP, kv_startup_capacity_bytes); a limit can only lower it",
}


def engine_label(model: dict[str, Any]) -> str:
    return str(model["engine"]) + (SIM_MARK if model.get("simulated") else "")


def kv_applied(model: dict[str, Any]) -> str:
    """KV APPLIED with why it differs from KV LIMIT: capped, not confirmed yet, not held."""
    applied, requested = model.get("kv_limit_applied_bytes"), model.get("kv_limit_requested_bytes")
    if requested is None and applied is None:
        return "-"
    if applied is None:
        return "pending"  # asked; the engine's segment has not confirmed it (yet)
    text = size(applied)
    if model.get("kv_limit_capped_by"):
        text += " (cap)"
    if "KVLimitNotHeld" in (model.get("conditions") or ()):
        text += " (not held)"
    return text


def current_error(model: dict[str, Any]) -> str:
    """What is wrong now: conditions, then the first line of ``last_error``."""
    first = (model.get("last_error") or "").splitlines()[:1]
    notes = [*(model.get("conditions") or ()), *first]
    if model.get("phase") == "failed":
        notes.append("activate again to restart it")
    return "; ".join(notes)


def last_exit(model: dict[str, Any]) -> str:
    first = (model.get("last_exit") or "").splitlines()[:1]
    return first[0] if first else "-"


def snapshot_table(snapshot: dict[str, Any], wide: bool = False) -> str:
    models = snapshot.get("models", [])
    head = ["MODEL", "ENGINE", "PHASE", "READY", "PORT", "PID", "RESTARTS", "RUNNING",
            "WAITING", "HBM", "KV LIMIT", "KV APPLIED", "KV USED"]
    if wide:
        head += ["KV CAP", "HBM PEAK", "ASLEEP HBM", "GPUS", "LAST EXIT"]
    head.append("ERROR")
    rows = [head]
    for m in models:
        row = [m["model_name"], engine_label(m), m["phase"], str(m["ready"]).lower(),
               str(m["port"]), str(m["pid"] or "-"), str(m["restart_count"]),
               number(m.get("requests_running")), number(m.get("requests_waiting")),
               size(m.get("hbm_bytes")), size(m.get("kv_limit_requested_bytes")),
               kv_applied(m), size(m.get("kv_used_bytes"))]
        if wide:
            row += [size(m.get("kv_startup_capacity_bytes")), size(m.get("hbm_peak_bytes")),
                    size(m.get("sleeping_footprint_bytes")),
                    ",".join(str(d) for d in m.get("devices") or ()) or "-", last_exit(m)]
        error = current_error(m)
        row.append(error if wide else error[:70])
        rows.append(row)
    lines = [columns(rows) if models else "No engines on this agent."]
    for gpu in snapshot.get("accelerators", []):
        lines.append(f"GPU {gpu['index']} {gpu['name']}: {size(gpu['hbm_used_bytes'])} used of "
                     f"{size(gpu['hbm_total_bytes'])}; room for new engines "
                     f"{size(gpu.get('hbm_room_bytes'))} (usable minus what engines hold or "
                     "are charged)")
    lines += _notes(snapshot)
    cached = snapshot.get("cached_artifacts") or []
    lines.append(f"observed at {snapshot.get('observed_at')}; cached artifacts: "
                 f"{', '.join(cached) if cached else 'none'}")
    return "\n".join(lines)


def _notes(snapshot: dict[str, Any]) -> list[str]:
    """What the marks in the table mean, only for the marks that appear."""
    models = snapshot.get("models", [])
    notes = []
    if any(m.get("simulated") for m in models) or snapshot.get("agent", {}).get(
            "simulated_engines"):
        notes.append("(sim): a simulated engine (python -m engines.sim) that speaks the "
                     "engine's API and flags; it runs no model and its answers are made up")
    if snapshot.get("node", {}).get("gpu_backend") == "simulated":
        notes.append("GPU memory is simulated (--gpu sim, or auto without a GPU): engines "
                     "report made-up allocations")
    for why in sorted({m["kv_limit_capped_by"] for m in models if m.get("kv_limit_capped_by")}):
        notes.append("(cap): " + CAP_NOTES.get(why, why))
    if any(m.get("kv_limit_requested_bytes") is not None and m.get("kv_limit_applied_bytes")
           is None for m in models):
        notes.append("pending: the limit is asked but the engine's KV segment has not confirmed "
                     "it yet (the engine is starting)")
    return notes
