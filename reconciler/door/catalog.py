"""Which claim serves a model name, under what name its engine knows it, and its context length.

Names come from two places:

* the claims: each claim's ``modelName`` (unique across claims), and for an Ollama claim also its
  Ollama tag (``ollama://qwen3:0.6b`` is served as ``qwen3:0.6b``: the door puts that name in the
  body it forwards, since an Ollama server knows no other);
* the engines: a vLLM engine's ``/v1/models`` lists its served names and the LoRA adapters it has
  loaded (``parent`` set to the base model) with each one's ``max_model_len``. The door learns
  them in the background when it first forwards to an engine, again when a name is unknown (at
  most once a second), and whenever ``/v1/models`` is listed. An Ollama server's list is every
  model installed on the node, not what it serves, so only its ``/api/ps`` context length is read.

The context length of a name: what its engine reported, else what the claim's engine arguments
declare (``--max-model-len``; ``--context-length`` for Ollama and SGLang), else unknown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from contract.engines import ollama_tag
from engine_http.calls import get_json
from engine_http.upstream import Upstream, authority
from reconciler.desired import ClaimKey, Desired
from reconciler.door.window import context_from_args
from reconciler.model.manifests import ModelClaim
from reconciler.replicas import replica_keys

log = logging.getLogger("reconciler.door.catalog")

LEARN_TIMEOUT_S = 2.0
REFRESH_EVERY_S = 1.0


@dataclass(frozen=True)
class Learned:
    """What an engine at ``host:port`` said it serves."""

    host: str
    port: int
    names: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()  # LoRA adapters among the names
    contexts: Mapping[str, int] = field(default_factory=dict)


class Catalog:
    """Names to claims; ``endpoint(key)`` says where a claim's engine process listens."""

    def __init__(self, desired: Desired,
                 endpoint: Callable[[ClaimKey], tuple[str, int] | None]) -> None:
        self._desired = desired
        self._endpoint = endpoint
        self._learned: dict[ClaimKey, Learned] = {}
        self._version = 0
        self._index: dict[str, tuple[ClaimKey, ...]] = {}
        self._indexed: tuple[object, int, int] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._refreshed_at = -1e9

    # ---- lookups (on every request; no I/O) -----------------------------------------------

    def claims_for(self, name: str) -> tuple[ClaimKey, ...]:
        claims = self._desired.claims
        if self._indexed is None or self._indexed[0] is not claims \
                or self._indexed[1] != self._version \
                or self._indexed[2] != self._desired.claims_version:
            self._reindex(claims)
        return self._index.get(name, ())

    def _reindex(self, claims: Mapping[ClaimKey, ModelClaim]) -> None:
        index: dict[str, list[ClaimKey]] = {}
        for key, claim in sorted(claims.items()):
            keys = [key, *replica_keys(key, claim.replicas)]  # every replica serves the name
            index.setdefault(claim.model_name, []).extend(keys)
            if claim.engine == "ollama":
                index.setdefault(ollama_tag(claim.artifact_url), []).extend(keys)
        for key, learned in sorted(self._learned.items()):
            if key in claims:
                for name in learned.names:
                    index.setdefault(name, []).extend([key, *replica_keys(
                        key, claims[key].replicas)])
        self._index = {name: tuple(dict.fromkeys(keys)) for name, keys in index.items()}
        self._indexed = (claims, self._version, self._desired.claims_version)

    @property
    def version(self) -> int:
        """Bumped whenever an engine told something new (names, contexts)."""
        return self._version

    def names(self) -> list[str]:
        self.claims_for("")
        return sorted(self._index)

    def claim(self, key: ClaimKey) -> ModelClaim | None:
        return self._desired.claim(key)

    def upstream_name(self, claim: ModelClaim, requested: str) -> str:
        """The model name to send to the claim's engine for a request that named ``requested``."""
        if claim.engine == "ollama" and requested == claim.model_name:
            return ollama_tag(claim.artifact_url)
        return requested

    def context(self, key: ClaimKey, requested: str) -> int | None:
        claim = self._desired.claim(key)
        if claim is None:
            return None
        learned = self._learned.get(key)
        if learned is not None:
            for name in (requested, self.upstream_name(claim, requested), claim.model_name):
                if name in learned.contexts:
                    return learned.contexts[name]
        return context_from_args(claim.engine, claim.engine_args)

    def adapters(self, key: ClaimKey) -> tuple[str, ...]:
        learned = self._learned.get(key)
        return learned.adapters if learned is not None else ()

    # ---- learning (background; never on a request's path except for an unknown name) ---------

    def learn_soon(self, http: Upstream, key: ClaimKey, host: str,
                   port: int) -> None:
        """Learn what the engine at ``host:port`` serves, unless that is known already."""
        learned = self._learned.get(key)
        if learned is not None and (learned.host, learned.port) == (host, port):
            return
        self._learned[key] = Learned(host, port)  # asked once per engine address
        task = asyncio.get_running_loop().create_task(self._learn(http, key, host, port))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def refresh(self, http: Upstream, keys: Iterable[ClaimKey],
                      force: bool = False) -> None:
        """Ask every engine of ``keys`` what it serves now (rate limited unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._refreshed_at < REFRESH_EVERY_S:
            return
        self._refreshed_at = now
        calls = []
        for key in keys:
            where = self._endpoint(key)
            if where is not None:
                calls.append(self._learn(http, key, *where))
        await asyncio.gather(*calls)

    async def _learn(self, http: Upstream, key: ClaimKey, host: str,
                     port: int) -> None:
        claim = self._desired.claim(key)
        if claim is None:
            return
        try:
            if claim.engine == "ollama":
                learned = Learned(host, port, contexts=await self._ollama_context(
                    http, (host, port), ollama_tag(claim.artifact_url)))
            else:
                learned = _from_models(host, port, await _get(http, (host, port), "/v1/models"))
        except (ValueError, TypeError, KeyError) as err:
            log.debug("door: could not learn what %s serves at %s: %s", claim.model_name,
                      authority(host, port), err)
            return
        self._learned[key] = learned
        self._version += 1

    async def _ollama_context(self, http: Upstream, where: tuple[str, int],
                              tag: str) -> dict[str, int]:
        doc = await _get(http, where, "/api/ps")
        for entry in doc.get("models") or ():
            if entry.get("name") == tag and isinstance(entry.get("context_length"), int):
                return {tag: int(entry["context_length"])}
        return {}

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _get(http: Upstream, where: tuple[str, int], path: str) -> dict[str, Any]:
    doc = await get_json(http, *where, path, LEARN_TIMEOUT_S)  # an engine's nesting bounded
    if not isinstance(doc, dict):
        raise ValueError(f"GET {path} answered no JSON object in time")
    return doc


def _from_models(host: str, port: int, doc: Mapping[str, Any]) -> Learned:
    """vLLM's ``/v1/models``: every id, the adapters (``parent`` set), each ``max_model_len``."""
    names, adapters, contexts = [], [], {}
    for entry in doc.get("data") or ():
        name = entry.get("id")
        if not isinstance(name, str):
            continue
        names.append(name)
        if entry.get("parent"):
            adapters.append(name)
        if isinstance(entry.get("max_model_len"), int):
            contexts[name] = int(entry["max_model_len"])
    return Learned(host, port, tuple(names), tuple(adapters), contexts)
