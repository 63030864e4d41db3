"""What a mutating command did, in one line, as kubectl says it (``-o json``: the raw answer).

``sleep qwen3-0.6b: asleep (level 1) in 0.8 s``; ``kv-limit m: unchanged, already 4.0GiB``.
The line is made from the agent's answer alone (``applied``, ``phase``, the figures it
returns), so it says what the agent did, not what the command hoped for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runtime_agent.console.output import size

PHASE_WORDS = {"sleeping": "asleep", "active": "awake"}


def result_line(command: str, model: str, answer: Mapping[str, Any], elapsed_s: float,
                level: int | None = None) -> str:
    """One line for the answer to ``command`` on ``model`` (``level``: a sleep's)."""
    head = f"{command} {model}"
    if answer.get("status") != "success":
        return f"{head}: {answer.get('status', 'refused')}: {answer.get('message', '')}".rstrip()
    applied = bool(answer.get("applied"))
    took = f" in {elapsed_s:.1f} s"
    phase = str(answer.get("phase", ""))
    if command == "kv-limit":
        return head + ": " + _kv_words(answer, applied)
    if command == "deactivate":
        if "phase" not in answer:  # nothing ran under that name
            return f"{head}: {answer.get('message', 'nothing to do')}"
        return f"{head}: {phase}{took}" + (f" ({answer['message']})" if answer.get("message")
                                           else "")
    if command == "activate":
        where = f" on port {answer['port']}" if answer.get("port") else ""
        pid = f" (pid {answer['pid']})" if answer.get("pid") else ""
        return (f"{head}: {phase}{where}{pid}" if applied
                else f"{head}: unchanged, already {phase}{where} with this spec")
    state = PHASE_WORDS.get(phase, phase)
    if not applied:
        return f"{head}: unchanged, already {state}"
    return f"{head}: {state}" + (f" (level {level})" if level is not None else "") + took


def _kv_words(answer: Mapping[str, Any], applied: bool) -> str:
    applied_bytes = answer.get("applied_bytes")
    capacity = answer.get("capacity_bytes")
    if applied_bytes is None:  # no segment yet: the limit waits for the engine
        return (f"{size(answer.get('requested_bytes'))} set; the engine has no KV segment "
                "yet, it is applied when it starts")
    if answer.get("clamped"):
        what = (f"{size(answer.get('requested_bytes'))} asked, capped at the engine's KV "
                f"capacity {size(capacity)}")
    else:
        what = f"{size(applied_bytes)} in force (the engine's KV capacity is {size(capacity)})"
    return what if applied else f"unchanged, already {what}"
