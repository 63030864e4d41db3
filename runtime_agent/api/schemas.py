"""What the agent answers, as pydantic models: the response half of ``/openapi.json``.

Requests are validated by ``runtime_agent.api.models``; these describe the answers, with the
exact JSON types AIBrix's controller decodes (an integer is ``integer``, never ``number``).
Extra fields are allowed (the answers carry more than the description names), so a client may
rely on every field named here and ignore the rest, as Go's decoder does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorAnswer(_Answer):
    status: Literal["error"]
    message: str = Field(description="what went wrong and what to do about it")
    reason: str | None = Field(default=None, description="a contract reason, e.g. "
                               "InsufficientGPUMemory")
    model_name: str | None = None
    phase: str | None = None
    operation_id: str | None = None
    applied: bool | None = None
    detail: list[dict[str, Any]] | None = Field(
        default=None, description="FastAPI's validation list (422), as the AIBrix sidecar has it")


class OperationAnswer(_Answer):
    status: Literal["success"]
    model_name: str
    applied: bool = Field(description="this call changed something (false: already so, or a "
                          "replayed operation_id)")
    in_force: bool = Field(description="the asked state holds now")
    operation_id: str | None = None
    phase: str | None = None


class ActivateAnswer(OperationAnswer):
    port: int
    ipc_name: str
    pid: int | None = None
    engine_id: str


class ModelInfo(_Answer):
    model_name: str
    engine: str
    port: int
    ipc_name: str
    phase: str
    ready: bool
    pid: int | None
    restart_count: int
    kv_used_bytes: int | None = None
    kv_total_bytes: int | None = None


class ModelList(_Answer):
    models: list[ModelInfo]


class ClaimRefAnswer(_Answer):
    namespace: str
    name: str
    uid: str


class SnapshotModel(_Answer):
    model_name: str
    engine: str
    artifact_url: str
    claim_ref: ClaimRefAnswer | None
    port: int
    ipc_name: str
    phase: str
    alive: bool
    ready: bool
    restart_count: int
    last_error: str | None
    last_transition: str | None
    kv_used_bytes: int | None
    kv_capacity_bytes: int | None
    hbm_peak_bytes: int | None
    request_metrics_observed: bool
    requests_running: int
    requests_waiting: int
    request_success_total: int | None


class Accelerator(_Answer):
    id: str
    hbm_total_bytes: int
    hbm_free_bytes: int


class Snapshot(_Answer):
    observed_at: str
    accelerators: list[Accelerator]
    models: list[SnapshotModel]
    cached_artifacts: list[str]


class Health(_Answer):
    status: str


class Readiness(_Answer):
    status: Literal["ready", "not ready"]
    reason: str | None = None


class ServedModel(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int | None


class ServedModels(_Answer):
    object: Literal["list"]
    data: list[ServedModel]


class Events(_Answer):
    events: list[dict[str, Any]]
    cursor: int


class EngineLog(_Answer):
    model_name: str
    lines: list[str]


class ArtifactEntry(_Answer):
    """One weight-cache entry, as ``GET /v1/model/list`` shows it."""

    artifact_id: str
    artifact_url: str
    source: str = Field(description="huggingface, s3 or local")
    revision: str | None
    resolved_revision: str | None = Field(description="the commit a Hub revision named")
    state: Literal["downloading", "ready", "failed"]
    bytes_done: int
    bytes_total: int
    rate_bytes_per_second: int | None
    eta_seconds: int | None
    files: int | None
    verified: list[str] = Field(description="the checksums every file was checked against")
    local_path: str | None = Field(description="where a ready copy lies")
    in_use: bool = Field(description="an engine runs on it (it cannot be freed)")
    staged_at: float | None
    last_used_at: float | None
    started_at: float | None
    error: str | None
    reason: str | None
    resumable: bool | None


class ArtifactList(_Answer):
    object: Literal["list"]
    data: list[ArtifactEntry]


class DownloadAnswer(ArtifactEntry):
    status: Literal["success"]
    started: bool = Field(description="false: the URL was staged or downloading already")


class ArtifactFreed(_Answer):
    status: Literal["success"]
    artifact_id: str
    artifact_url: str
    message: str
