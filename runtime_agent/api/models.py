"""Request bodies of the control API: strict pydantic models, refusals that name the field.

Field names follow the AIBrix runtime sidecar, so its controller drives this agent unchanged
(``shared/aibrix-wire.md``). As the sidecar does, unknown fields are refused, and a body that
does not validate is a 422 with FastAPI's ``detail`` list; ours adds one ``message`` line per
problem. Types are exact: no boolean for a number, no string for a number, no fraction for an
integer. The same models describe the API in ``/openapi.json``.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from contract.engines import AGENT_ENGINES
from contract.names import (
    ipc_name_for,
    model_name_problem,
    sanitise_ipc_name,
    sent_ipc_name_problem,
)
from registry.record import ClaimRef, EngineSpec, PerGpu
from runtime_agent.supervision.pool import Activation

# The longest any request may wait for memory; a client that wants longer asks again.
MAX_WAIT_SECONDS = 600
MAX_OPERATION_ID = 256
OperationId = Annotated[str, Field(min_length=1, max_length=MAX_OPERATION_ID,
                                   pattern=r"^[^\x00-\x1f\x7f]*$")]
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# The agent's own settings in an engine's environment; credentials cannot override them.
_RESERVED_ENV_PREFIXES = ("AIBRIX_", "KVCACHED_", "VLLM_SERVER_DEV_MODE", "ENABLE_KVCACHED",
                          "CUDA_", "OLLAMA_HOST", "OLLAMA_KEEP_ALIVE", "SPT_NOENV", "PATH",
                          "LD_", "PYTHON")
Engine = Literal["vllm", "sglang", "ollama", "sim"]
assert set(AGENT_ENGINES) == {"vllm", "sglang", "ollama", "sim"}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# The name rule (contract.names) as a JSON Schema pattern, so /openapi.json says what the
# validator checks (pydantic's own regex engine has no look-ahead; the validator does it).
MODEL_NAME_PATTERN = r"^(?!.*\.\.)(?!.*//)(?!.*/$)[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class _ModelRequest(_Request):
    model_name: str = Field(min_length=1, max_length=128, description="the served model name",
                            json_schema_extra={"pattern": MODEL_NAME_PATTERN})

    @field_validator("model_name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        problem = model_name_problem(value)
        if problem:
            raise ValueError(problem)
        return value


Flag = Annotated[str, Field(min_length=2, max_length=128)]
FlagValue = Annotated[str, Field(max_length=8192)]


class EngineConfig(_Request):
    args: dict[Flag, FlagValue] = Field(
        default_factory=dict, max_length=256,
        description="engine flags to values; \"\" for a bare flag")


class ClaimRefBody(BaseModel):
    """The claim an activation is for (``registry.record.ClaimRef`` once accepted)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str = Field(default="", max_length=253)
    name: str = Field(default="", max_length=253)
    uid: str = Field(default="", max_length=128)


class PerGpuBody(BaseModel):
    """What one instance needs on each of its GPUs (``registry.record.PerGpu`` once accepted)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    maximum_footprint_bytes: int = Field(gt=0)
    kv_floor_bytes: int = Field(gt=0)


class ActivateRequest(_ModelRequest):
    artifact_url: str = Field(min_length=1, max_length=2048)
    engine: Engine = "vllm"
    port: int = Field(default=0, ge=0, le=65535, description="0 lets the agent pick one")
    ipc_name: str | None = Field(
        default=None, description="the kvcached segment name; sanitised as kvcached does "
        "(kvc_qwen3-0.6b becomes kvc_qwen3-0-6b); empty or absent: kvc_<model_name>")
    credentials: dict[str, str] | None = Field(
        default=None, max_length=64,
        description="environment variables for the engine alone (HF_TOKEN, AWS_*); never "
        "logged, shown or written where others can read them")
    engine_config: EngineConfig | None = None
    claim_ref: ClaimRefBody | None = None
    kv_limit_bytes: int | None = Field(default=None, gt=0, le=2**62)
    per_gpu: PerGpuBody | None = None
    wait_seconds: float = Field(default=0, ge=0, le=MAX_WAIT_SECONDS,
                                description="wait this long for GPU memory instead of refusing")

    @field_validator("ipc_name")
    @classmethod
    def _sanitised_ipc(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        problem = sent_ipc_name_problem(value)
        if problem:
            raise ValueError(problem)
        return sanitise_ipc_name(value)

    @field_validator("credentials")
    @classmethod
    def _valid_credentials(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, secret in (value or {}).items():
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(f"credential name {key!r} is not an environment variable name")
            if key.upper().startswith(_RESERVED_ENV_PREFIXES):
                raise ValueError(f"credential name {key!r} is the agent's own setting")
            if "\x00" in secret or len(secret) > 65536:
                raise ValueError(f"credential {key!r} holds a NUL byte or is over 64 KiB")
        return value

    def activation(self) -> Activation:
        spec = EngineSpec(model_name=self.model_name, artifact_url=self.artifact_url,
                          engine=self.engine, ipc_name=self.ipc_name or ipc_name_for(self.model_name),
                          args=self.engine_config.args if self.engine_config else {},
                          claim_ref=ClaimRef(**self.claim_ref.model_dump()) if self.claim_ref
                          else None)
        per_gpu = PerGpu(**self.per_gpu.model_dump()) if self.per_gpu else None
        return Activation(spec, self.port, self.kv_limit_bytes, per_gpu, self.wait_seconds,
                          dict(self.credentials or {}))


class DeactivateRequest(_ModelRequest):
    mode: Literal["stop"] = "stop"


class SleepRequest(_ModelRequest):
    level: Literal[1, 2] = 1
    operation_id: OperationId | None = None


class WakeRequest(_ModelRequest):
    operation_id: OperationId | None = None
    wait_seconds: float = Field(default=0, ge=0, le=MAX_WAIT_SECONDS)


class KvLimitRequest(_ModelRequest):
    limit_bytes: int = Field(ge=0, le=2**62,
                             description="bytes of KV cache; 0 lifts the limit (full capacity)")
    operation_id: OperationId | None = None


# ---- LoRA adapters, as the AIBrix sidecar takes them ---------------------------------------------


class _AdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=128, pattern=ADAPTER_NAME_PATTERN)
    model_name: str | None = Field(
        default=None, min_length=1, max_length=128,
        description="the base model (ours: the sidecar serves one); may be left out when one "
        "model here was started for LoRA")


class LoadLoraAdapterRequest(_AdapterRequest):
    """Direct: the engine loads the adapter from ``lora_path`` (a local directory or a
    Hugging Face repo id)."""

    lora_path: str = Field(min_length=1, max_length=4096)


class LoadLoraAdapterRuntimeRequest(_AdapterRequest):
    """Delegated: the adapter is named by URL (``hf://``, ``huggingface://``, ``file://``)."""

    artifact_url: str = Field(min_length=1, max_length=2048)
    credentials_secret: str | None = None
    credentials: dict[str, str] | None = None
    additional_config: dict[str, str] | None = None
    local_dir: str | None = None


class UnloadLoraAdapterRequest(_AdapterRequest):
    lora_int_id: int | None = None


class UnloadLoraAdapterRuntimeRequest(_AdapterRequest):
    cleanup_local: bool = True


# The sidecar's own unions: a body with artifact_url is delegated; for an unload, a plain
# {"lora_name"} matches both and the first (delegated) wins, as FastAPI's smart union picks it.
LOAD_ADAPTER = TypeAdapter(LoadLoraAdapterRuntimeRequest | LoadLoraAdapterRequest)
UNLOAD_ADAPTER = TypeAdapter(UnloadLoraAdapterRuntimeRequest | UnloadLoraAdapterRequest)


# ---- the weight cache ----------------------------------------------------------------------------


class DownloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # The sidecar's own request calls it model_uri; both spellings are taken.
    artifact_url: str = Field(min_length=1, max_length=2048,
                              validation_alias=AliasChoices("artifact_url", "model_uri"))
    credentials: dict[str, str] = Field(default_factory=dict)
    revision: str | None = Field(default=None, min_length=1, max_length=255)
