"""An engine's start that waits for the weight cache: functions over ``EngineOwner``.

When the cache holds the artifact, the engine starts on the entry's directory. When the engine
cannot fetch the artifact itself (``s3://``), or the cache is fetching it right now, the start
waits: a helper task waits for the cache and posts its progress (``StagingProgress``) and its
end (``Staged``); the phase stays ``activating`` or ``restarting`` with the ``Staging`` condition
and the live byte counts. A failed staging fails the engine with ``StagingFailed`` and why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from contract.phases import Phase
from runtime_agent.artifacts.staging import StagingFailed
from runtime_agent.supervision.messages import Staged, StagingProgress

if TYPE_CHECKING:
    from runtime_agent.supervision.owner import EngineOwner

STAGING_FAILED = "StagingFailed"


def stage_first(owner: EngineOwner, reason: str) -> bool:
    """Whether the start must wait for the weight cache; then a helper waits for it."""
    stager = owner._deps.stager
    if stager is None:
        return False
    owner._model_path = stager.model_path(owner.spec)
    if owner._model_path is not None or not stager.must_stage(owner.spec):
        return False
    owner._stage_token += 1
    token, post, spec = owner._stage_token, owner._inbox.put_nowait, owner.spec
    credentials = dict(owner.record.credentials)

    async def stage() -> None:
        try:
            path = await stager.stage(spec, lambda view: post(StagingProgress(token, view)),
                                      credentials)
            post(Staged(token, reason, path, None))
        except StagingFailed as exc:
            post(Staged(token, reason, None, str(exc)))

    owner._helper(stage())
    return True


def _waiting(owner: EngineOwner, token: int) -> bool:
    """Still the wait in force: not stopped, nor started another way, meanwhile."""
    return (token == owner._stage_token and owner._proc is None
            and owner.view.phase in (Phase.ACTIVATING, Phase.RESTARTING))


def on_progress(owner: EngineOwner, progress: StagingProgress) -> None:
    if not _waiting(owner, progress.token):
        return
    first = owner._staging is None
    owner._staging = progress.view
    if first:
        owner._emit("Staging", f"waiting for {owner.spec.artifact_url} in the weight cache")


async def on_staged(owner: EngineOwner, staged: Staged) -> None:
    if not _waiting(owner, staged.token):
        return
    owner._staging = None
    if staged.path is not None:
        owner._model_path = staged.path
        await owner._spawn(staged.reason)
        return
    owner.record.last_error = f"staging {owner.spec.artifact_url} failed: {staged.error}"
    owner._deps.memory.stopped(owner.name)
    await owner._transition(Phase.FAILED, STAGING_FAILED, owner.record.last_error)
    if not owner.spawned.done():
        owner.spawned.set_result(owner.record.last_error)
