"""Request bodies of the control API, validated by pydantic, with messages that say what to fix.

Field names follow the published ModelClaim runtime agent so its controller can drive this one.
Unknown fields are ignored (a newer controller may send more); wrong types and bad values are a
400 whose message names the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from contract.names import ipc_name_for, ipc_name_problem, model_name_problem
from registry.record import ClaimRef, EngineSpec, PerGpu
from runtime_agent.supervision.pool import Activation


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _ModelRequest(_Request):
    model_name: str

    @field_validator("model_name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        problem = model_name_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class EngineConfig(_Request):
    args: dict[str, str] = Field(default_factory=dict)

    @field_validator("args", mode="before")
    @classmethod
    def _stringify(cls, value: Any) -> Any:
        """Flag values are strings; numbers and booleans are accepted and written as text."""
        if not isinstance(value, dict):
            return value
        out: dict[Any, Any] = {}
        for key, item in value.items():
            if isinstance(item, bool):
                item = "true" if item else "false"
            elif isinstance(item, int | float):
                item = str(item)
            elif item is None:
                item = ""
            out[key] = item
        return out


class ActivateRequest(_ModelRequest):
    artifact_url: str = Field(min_length=1)
    engine: Literal["vllm", "ollama", "sim"] = "vllm"
    port: int = Field(default=0, ge=0, le=65535)
    ipc_name: str | None = None
    engine_config: EngineConfig = Field(default_factory=EngineConfig)
    claim_ref: ClaimRef | None = None
    kv_limit_bytes: int | None = Field(default=None, gt=0, le=2**62)
    per_gpu: PerGpu | None = None
    # Wait this long for GPU memory to free up instead of refusing at once (woken by changes).
    wait_seconds: float = Field(default=0, ge=0, le=3600)

    def activation(self) -> Activation:
        spec = EngineSpec(model_name=self.model_name, artifact_url=self.artifact_url,
                          engine=self.engine, ipc_name=self.ipc_name or ipc_name_for(self.model_name),
                          args=self.engine_config.args, claim_ref=self.claim_ref)
        return Activation(spec, self.port, self.kv_limit_bytes, self.per_gpu, self.wait_seconds)

    @field_validator("ipc_name")
    @classmethod
    def _valid_ipc(cls, value: str | None) -> str | None:
        if value is not None:
            problem = ipc_name_problem(value)
            if problem:
                raise ValueError(problem)
        return value


class DeactivateRequest(_ModelRequest):
    mode: Literal["stop"] = "stop"


class SleepRequest(_ModelRequest):
    level: Literal[1, 2] = 1
    operation_id: str | None = Field(default=None, min_length=1, max_length=256)


class WakeRequest(_ModelRequest):
    operation_id: str | None = Field(default=None, min_length=1, max_length=256)
    wait_seconds: float = Field(default=0, ge=0, le=3600)


class KvLimitRequest(_ModelRequest):
    limit_bytes: int = Field(gt=0, le=2**62)
    operation_id: str | None = Field(default=None, min_length=1, max_length=256)


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``field: what is wrong``."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "body"
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "is required"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)
