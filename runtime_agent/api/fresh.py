"""``GET /v1/runtime/snapshot?fresh=requests``: the snapshot with request figures read now.

A steady engine's scrapes back off to ``--scrape-interval-max`` (20 s), so the plain
snapshot's request figures may be that old. A controller about to put a model to sleep for
idleness must not judge by them: a request sent straight to the engine (past the door, as the
AIBrix gateway sends them) in the last seconds shows only in the engine's own figures. So the
last look asks for them fresh:

- each active engine named by ``model=`` (repeatable; every engine when none is named) is read
  by an engine call that began after this request came (``EngineOwner.fresh_figures``), all at
  once, each within the probe timeout (twice that when a look was already running);
- an entry read so carries those figures, ``request_figures_at`` set to the moment the call
  began (never later than the reading), and ``request_figures_fresh: true``;
- an entry asked for that did not answer, gave no figures, or was not active in the same
  process before and after says ``request_metrics_observed: false`` and
  ``request_figures_fresh: false``: never the old figure presented as fresh;
- entries not asked for are as in the plain snapshot; the answer is not cached (no ETag).
"""

from __future__ import annotations

import asyncio
from typing import Any

from msgspec.structs import replace

from engines.driver import Observation
from runtime_agent.api.errors import BadRequest
from runtime_agent.api.snapshot import request_fields
from runtime_agent.supervision.views import EngineView

FRESH_KINDS = ("requests",)


async def fresh_snapshot(agent: Any, names: list[str]) -> dict[str, Any]:
    owners = agent.pool.owners
    unknown = [n for n in names if n not in owners]
    if unknown:
        raise BadRequest(f"model {unknown[0]!r} is not on this agent (query parameter model)", 404)
    asked = list(dict.fromkeys(names)) or list(owners)
    begun = {n: owners[n].clock.wall() for n in asked}
    read = await asyncio.gather(*(owners[n].fresh_figures() for n in asked))
    snap: dict[str, Any] = agent.snapshot()
    entries = {m["model_name"]: m for m in snap["models"]}
    for name, figures in zip(asked, read, strict=True):
        owner, entry = owners.get(name), entries.get(name)
        if owner is None or entry is None:
            continue  # stopped meanwhile: not in this snapshot
        entry.update(request_fields(_read_now(owner.view, figures, begun[name])))
        entry["request_figures_fresh"] = entry["request_metrics_observed"]
    return snap


def _read_now(view: EngineView, figures: Observation | None, begun: float) -> EngineView:
    """The view as the fresh figures show it; without them, one whose figures are unknown."""
    if figures is None:
        return replace(view, request_success_total=None)
    return replace(view, requests_running=figures.running, requests_waiting=figures.waiting,
                   request_success_total=figures.success_total, figures_at=begun)
