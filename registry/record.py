"""The engine record: what the agent persists about one engine.

One record per engine, stored as its own JSON file (see ``registry.store``). It holds the
desired state (the spec the engine was activated with, awake or asleep) and the last observed
facts needed to re-adopt the engine after an agent restart (PID, process start time, port).

The record is plain data. Only an engine's owner task changes it, and it writes the record
durably before each process start and on every phase transition.

The types are msgspec Structs, read and written by ``msgspec.json`` (``decode`` validates as it
decodes: types, literals, bounds, and no unknown field in the nested parts; an unknown field of
the record itself is ignored, as a newer agent's may be). A re-adopting agent reads every record
before it answers: with pydantic models, the first read cost the model machinery's import and
six model builds (about 80 ms here, more than the 32 reads), with Structs nothing
(``bench/RESULTS.md`` figure 15).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field

from contract.phases import Phase
from guard.redact import repr_without

RECORD_VERSION = 1


EngineKind = Literal["vllm", "sglang", "ollama", "sim"]
Desired = Literal["awake", "asleep"]

# Operation results kept per record for idempotency; the oldest are dropped first.
MAX_OPERATIONS = 64


KubeName = Annotated[str, Meta(max_length=253)]
Positive = Annotated[int, Meta(gt=0)]


class ClaimRef(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    namespace: KubeName = ""
    name: KubeName = ""
    uid: Annotated[str, Meta(max_length=128)] = ""


class EngineSpec(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What an engine was activated with. Two activations with equal specs are the same."""

    model_name: str
    artifact_url: str
    engine: EngineKind = "vllm"
    ipc_name: str
    args: dict[str, str] = field(default_factory=dict)
    claim_ref: ClaimRef | None = None


class PerGpu(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What one instance needs on each of its GPUs (the seed's perGPU)."""

    maximum_footprint_bytes: Positive
    kv_floor_bytes: Positive

    @property
    def need_bytes(self) -> int:
        return self.maximum_footprint_bytes + self.kv_floor_bytes


class LoraAdapter(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A LoRA adapter the engine serves under ``name``, loaded at run time from ``path``."""

    name: str
    path: str  # a local directory or a Hugging Face repo id, as the engine loads it
    artifact_url: str | None = None  # where it came from, when it was named by URL


class InFlight(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A sleep or wake the agent started and had not seen end: written before the engine is
    called, cleared when the call returns. An agent that finds one after a restart resolves it
    by asking the engine, never by assuming the call went through."""

    action: Literal["sleep", "wake"]
    level: int = 1
    started_at: float = 0.0


class EngineRecord(Struct, kw_only=True):
    version: int = RECORD_VERSION
    engine_id: str
    spec: EngineSpec
    port: int
    desired: Desired = "awake"
    sleep_level: int | None = None
    pid: int | None = None
    pid_start_time: int | None = None
    phase: Phase = Phase.ACTIVATING
    restart_count: int = 0
    # What is wrong now (cleared when the engine is ready again), and how its process last ended
    # without being asked to (kept: history, not an error).
    last_error: str | None = None
    last_exit: str | None = None
    last_transition: float = 0.0
    created_at: float = 0.0
    # The most GPU memory process ``hbm_peak_pid`` held, as the agent last wrote it (at each
    # record write): a re-adopting agent goes on from it instead of starting the peak again.
    hbm_peak_bytes: int | None = None
    hbm_peak_pid: int | None = None
    operations: dict[str, dict[str, Any]] = field(default_factory=dict)
    # GPU placement: the cards the engine runs on, and what it declared it needs on each.
    devices: list[int] = field(default_factory=list)
    per_gpu: PerGpu | None = None
    # KV-cache limit: what was asked, and the segment it was applied to (capacity, inode).
    kv_limit_bytes: int | None = None
    kv_capacity_bytes: int | None = None
    kv_inode: int | None = None
    kv_applied_bytes: int | None = None
    # The inode of the claim marker beside the segment (``runtime_agent.kv.ownership``): the
    # proof that the segment name is this agent's engine's, taken before the first start.
    kv_owner_inode: int | None = None
    # Lifetime counters kept with the record so metrics do not drop to zero on an agent restart.
    op_counts: dict[str, int] = field(default_factory=dict)  # "sleep:success" -> n
    budget_exhausted: int = 0
    # Environment variables for the engine alone (HF_TOKEN, AWS_*): kept only here (a 0600
    # file in a 0700 directory) and in the engine's own environment; never shown or logged.
    credentials: dict[str, str] = field(default_factory=dict)  # no repr
    # The sleep or wake in flight (None: none): resolved by observation after an agent restart.
    operation: InFlight | None = None
    # When the engine last became ready without a crash since: its restart budget starts
    # again after it served for a while (``budget_reset_s``).
    healthy_since: float | None = None
    # LoRA adapters to serve: loaded again after every restart and checked after re-adoption.
    adapters: list[LoraAdapter] = field(default_factory=list)

    def __repr__(self) -> str:
        return repr_without(self, ("credentials",))

    def count_operation(self, action: str, result: str) -> None:
        key = f"{action}:{result}"
        self.op_counts[key] = self.op_counts.get(key, 0) + 1

    def remember_operation(self, operation_id: str, result: dict[str, Any]) -> None:
        """Keep an operation's result for idempotent replays, dropping the oldest past the cap."""
        self.operations[operation_id] = result
        while len(self.operations) > MAX_OPERATIONS:
            del self.operations[next(iter(self.operations))]
