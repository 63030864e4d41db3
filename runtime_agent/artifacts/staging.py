"""The cache as an engine start sees it: which local path to start on, and what to stage first.

An engine whose artifact is ready in the cache starts on the entry's directory. One whose
artifact the engine cannot fetch itself (``s3://``), or that the cache is downloading right now
(a pre-stage: a second transfer would only compete with it), waits for the cache first; its
owner shows the wait as the ``Staging`` condition with the entry's live progress. Everything
else (Hub repositories, local paths, Ollama tags) starts as it always did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime_agent.artifacts.cache import ArtifactCache
from runtime_agent.artifacts.entries import EntryState
from runtime_agent.artifacts.urls import (
    ArtifactRequestError,
    SourceKind,
    parse_artifact,
)
from runtime_agent.artifacts.verify import Progress

if TYPE_CHECKING:
    from registry.record import EngineSpec

ENGINE_FETCHES = (SourceKind.HUB, SourceKind.LOCAL)
REVISION_FLAG = "--revision"


class StagingFailed(Exception):
    """The artifact could not be staged; the message says why (the entry's error)."""


@dataclass(frozen=True)
class StagingView:
    """What an activating engine waits for: an entry and its live byte counter."""

    artifact_id: str
    artifact_url: str
    progress: Progress

    def as_dict(self) -> dict[str, Any]:
        return {"artifact_id": self.artifact_id, "artifact_url": self.artifact_url,
                "bytes_done": self.progress.done, "bytes_total": self.progress.total}


def spec_artifact(spec: EngineSpec) -> tuple[str, str | None]:
    """The artifact URL and the Hub revision (vLLM's ``--revision``, if given) of an engine."""
    return spec.artifact_url, spec.args.get(REVISION_FLAG) or None


def engine_users(specs: Iterable[tuple[str, EngineSpec]]) -> list[tuple[str, str, str | None]]:
    """(model, url, revision) for the cache's pins, from (model, spec) of live engines."""
    return [(model, *spec_artifact(spec)) for model, spec in specs if spec.engine != "ollama"]


class EngineStager:
    def __init__(self, cache: ArtifactCache) -> None:
        self._cache = cache

    def model_path(self, spec: EngineSpec) -> str | None:
        """The ready entry's directory to start the engine on, or None."""
        if spec.engine == "ollama":
            return None
        entry = self._cache.lookup(*spec_artifact(spec))
        if entry is None or entry.state is not EntryState.READY:
            return None
        self._cache.mark_used(entry)
        return str(self._cache.path_of(entry))

    def must_stage(self, spec: EngineSpec) -> bool:
        """Not ready, and either the engine cannot fetch it or the cache is fetching it now."""
        if spec.engine == "ollama":
            return False
        url, revision = spec_artifact(spec)
        try:
            ref = parse_artifact(url, revision)
        except ArtifactRequestError:
            return False  # not the cache's to fetch: the engine is started as given
        entry = self._cache.get(ref.entry_id)
        if entry is not None and entry.state is EntryState.DOWNLOADING:
            return True
        return ref.kind not in ENGINE_FETCHES

    async def stage(self, spec: EngineSpec,
                    on_start: Callable[[StagingView], None] | None = None,
                    credentials: dict[str, str] | None = None) -> str:
        """Start or join the download and wait for it; the entry's directory. ``credentials``
        are the activation's (else the agent's environment is used)."""
        url, revision = spec_artifact(spec)
        try:
            entry, _ = await self._cache.request(url, revision, credentials or {})
        except ArtifactRequestError as exc:
            raise StagingFailed(str(exc)) from None
        if on_start is not None:
            on_start(StagingView(entry.entry_id, entry.ref.url, entry.progress))
        entry = await self._cache.wait(entry)
        if entry.state is not EntryState.READY:
            raise StagingFailed(entry.error or f"staging {url} did not finish")
        self._cache.mark_used(entry)
        return str(self._cache.path_of(entry))
