"""Ollama's own API at the door, for the tools that speak it: ``/api/tags``, ``/api/ps``, bodies.

An Ollama claim is reached by its tag (``ollama://qwen3:0.6b`` is ``qwen3:0.6b``) through
``POST /api/chat`` and ``/api/generate``, routed, held and counted as chat is. Two things differ
from forwarding an OpenAI body untouched:

* ``keep_alive`` is taken out of the body (``native_body``): with it a client decides how long
  the engine keeps its model loaded (``0`` unloads it at once, ``"5m"`` unloads it five minutes
  later), behind the reconciler's back, which then sees a model that unloaded itself. The pool
  keeps the model loaded (the agent runs ``ollama serve`` with ``OLLAMA_KEEP_ALIVE=-1``) until
  its own idle policy, or ``POST /v1/models/{model}/release``, lets it go;
* ``GET /api/tags`` and ``GET /api/ps`` are the door's view, not one server's: the tags list
  every Ollama claim the API key may use, ``ps`` those whose model serves now (awake), each in
  Ollama's shape. An engine's own entry for its tag is used where the engine answers (size,
  digest, details, ``size_vram``, ``context_length``, ``expires_at``); a claim whose engine does
  not answer (asleep or starting) is listed in ``/api/tags`` with what the claim says.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from contract.engines import ollama_tag
from engine_http.calls import get_json
from engine_http.upstream import Upstream
from reconciler.desired import ClaimKey

ASK_TIMEOUT_S = 2.0


def native_body(doc: Mapping[str, Any], body: bytes, tag: str) -> bytes:
    """The body for the Ollama server: its model named by ``tag``, no ``keep_alive``."""
    if doc.get("model") == tag and "keep_alive" not in doc:
        return body
    return json.dumps({**{k: v for k, v in doc.items() if k != "keep_alive"},
                       "model": tag}).encode()


def _stamp(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).isoformat().replace("+00:00", "Z")


def claimed_entry(tag: str, created: float) -> dict[str, Any]:
    """An ``/api/tags`` entry from the claim alone (its engine does not answer now)."""
    return {"name": tag, "model": tag, "modified_at": _stamp(created), "size": 0,
            "digest": "", "details": {"parent_model": "", "format": "gguf", "family": "",
                                      "families": None, "parameter_size": "",
                                      "quantization_level": ""}}


async def engine_entry(http: Upstream, where: tuple[str, int], path: str,
                       tag: str) -> dict[str, Any] | None:
    """The engine's own entry for ``tag`` in its ``path`` (``/api/tags``, ``/api/ps``)."""
    doc = await get_json(http, *where, path, ASK_TIMEOUT_S)
    for entry in (doc.get("models") or ()) if isinstance(doc, dict) else ():
        if isinstance(entry, dict) and tag in (entry.get("name"), entry.get("model")):
            return entry
    return None


class Listing:
    """One ``/api/tags`` or ``/api/ps`` answer: what each Ollama claim's engine says of it."""

    def __init__(self, http: Upstream) -> None:
        self.http = http

    async def build(self, which: str, claims: list[tuple[ClaimKey, str, float, str,
                                                         tuple[str, int] | None]]
                    ) -> dict[str, Any]:
        """``claims``: (key, artifact, created, route state, engine address) of each Ollama
        claim the caller may see; ``which`` is ``tags`` or ``ps``."""
        path = "/api/" + which
        wanted = [(ollama_tag(artifact), created, state, where)
                  for _, artifact, created, state, where in claims
                  if which == "tags" or state == "active"]
        found = await asyncio.gather(*(
            engine_entry(self.http, where, path, tag) if where is not None
            and (which == "tags" or state == "active") else _none()
            for tag, _, state, where in wanted))
        models = []
        for (tag, created, _, _), entry in zip(wanted, found):
            if entry is None and which == "ps":
                continue  # an engine that does not say it has the model loaded
            models.append(entry if entry is not None else claimed_entry(tag, created))
        return {"models": models}


async def _none() -> None:
    return None


__all__ = ["Listing", "native_body"]
