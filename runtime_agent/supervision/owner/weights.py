"""An engine's start that waits for the weight cache: the staging slot, which returns plans.

When the cache holds the artifact, the engine starts on the entry's directory. When the engine
cannot fetch the artifact itself (``s3://``), or the cache is fetching it right now, the start
waits: a helper task waits for the cache and posts its progress (``StagingProgress``) and its
end (``Staged``); the phase stays ``activating`` or ``restarting`` with the ``Staging`` condition
and the live byte counts. A failed staging fails the engine with ``StagingFailed`` and why.
The slot keeps the path, the view and the token of the wait in force; what the loop does with
an answer (start, fail, or nothing) is a plan it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from msgspec import Struct

from runtime_agent.supervision.messages import Message, Staged, StagingProgress

if TYPE_CHECKING:
    from registry.record import EngineRecord
    from runtime_agent.artifacts.staging import EngineStager, StagingView

STAGING_FAILED = "StagingFailed"


class StartOn(Struct, frozen=True):
    """Staged: start the engine (on the slot's ``model_path``)."""

    reason: str


class FailWith(Struct, frozen=True):
    """The staging failed: the engine fails with this error."""

    error: str


class StagingSlot:
    def __init__(self, stager: EngineStager | None, post: Callable[[Message], None]) -> None:
        self._stager, self._post = stager, post
        self._model_path: str | None = None  # the weight cache's copy the engine starts on
        self._view: StagingView | None = None  # the staging it waits for
        self._token = 0

    @property
    def model_path(self) -> str | None:
        return self._model_path

    @property
    def view(self) -> StagingView | None:
        return self._view

    def first(self, record: EngineRecord,
              reason: str) -> Coroutine[Any, Any, None] | None:
        """The helper that waits for the weight cache, when the start must wait for it."""
        stager, spec = self._stager, record.spec
        if stager is None:
            return None
        self._model_path = stager.model_path(spec)
        if self._model_path is not None or not stager.must_stage(spec):
            return None
        self._token += 1
        token, post, credentials = self._token, self._post, dict(record.credentials)

        from runtime_agent.artifacts.staging import StagingFailed  # loaded with the cache

        async def stage() -> None:
            try:
                path = await stager.stage(spec, lambda view: post(StagingProgress(token, view)),
                                          credentials)
                post(Staged(token, reason, path, None))
            except StagingFailed as exc:
                post(Staged(token, reason, None, str(exc)))

        return stage()

    def progress(self, progress: StagingProgress, waiting: bool) -> bool:
        """Take the progress in; True when it is the wait's first word (an event is due).
        ``waiting``: the start still waits (not stopped, nor started another way)."""
        if not waiting or progress.token != self._token:
            return False
        first = self._view is None
        self._view = progress.view
        return first

    def staged(self, staged: Staged, waiting: bool, url: str) -> StartOn | FailWith | None:
        if not waiting or staged.token != self._token:
            return None
        self._view = None
        if staged.path is not None:
            self._model_path = staged.path
            return StartOn(staged.reason)
        return FailWith(f"staging {url} failed: {staged.error}")
