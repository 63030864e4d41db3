"""Fakes for the claim reconciler's unit tests: a scriptable agent and a rig that wires it.

``FakeAgent`` answers the agent API (``agent_client.AgentApi``) from a dict of engines that
the test moves between phases by hand; every call is recorded. ``Rig`` builds the reconcilers'
``Deps`` on a ``FakeClock`` with the fake agents, a manifest directory and an in-memory status
store, so a test is: write manifests, reconcile, change the fake world, reconcile, assert.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from contract.quantity import GiB, MiB
from reconciler.claims import ClaimReconciler
from agent_client import ActivateSpec, AgentUnreachable, Reply
from reconciler.context import Deps
from reconciler.desired import ClaimKey
from reconciler.local.desired import DesiredState
from reconciler.kv import KvReconciler
from reconciler.observe import IdleTracker, SnapshotCache
from reconciler.runtime.controller import Result
from reconciler.status import ClaimStatus
from reconciler.store import StatusStore
from tests.clocks import FakeClock

POOL_LABELS = {"claim.model.aibrix.ai/pool": "pool-a", "claim.model.aibrix.ai/enabled": "true"}
SLEEPING_FOOTPRINT = 512 * MiB
_ports = itertools.count(20000)


class FakeAgent:
    """One agent: ``gpus`` cards of ``card`` bytes, ``reserve`` kept out of each."""

    def __init__(self, name: str, gpus: int = 1, card: int = 16 * GiB,
                 reserve: int = 1 * GiB) -> None:
        self.name = name
        self._url = f"http://{name}.pool:8080"
        self.gpus = gpus
        self.card = card
        self.reserve = reserve
        self.models: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.reachable = True
        self.activate_reply: Reply | None = None  # answer activations with this instead
        self.wake_reply: Reply | None = None
        self.sleep_refused: set[str] = set()  # models whose sleep is refused (409)
        self.measures_sleep = True  # False: sleeping footprints stay unknown (no NVML figures)
        self.unconfirmed_kv: set[str] = set()  # kv-limit answers applied: false for these
        self.cached: list[str] = []
        self.staging: list[str] = []  # artifacts its weight cache is downloading
        self.snapshots = 0
        # What an engine shows now that the agent's last scrape does not (a request sent
        # straight to it while scrapes back off): seen only by a fresh look.
        self.live: dict[str, dict[str, Any]] = {}
        self.fresh_answers = True  # False: the engines do not answer a fresh look
        self.on_snapshot: Callable[[int], None] | None = None  # called with the count

    @property
    def url(self) -> str:
        return self._url

    def _check(self) -> None:
        if not self.reachable:
            raise AgentUnreachable(f"{self.name}: connection refused")

    def calls_of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == kind]

    # ---- the API ----------------------------------------------------------------------------

    async def snapshot(self) -> dict[str, Any]:
        self._check()
        self.snapshots += 1
        if self.on_snapshot is not None:
            self.on_snapshot(self.snapshots)
        accelerators = [{"index": i, "hbm_total_bytes": self.card,
                         "hbm_usable_bytes": self.card - self.reserve, "hbm_used_bytes": 0,
                         "hbm_used_by_engines_bytes": 0} for i in range(self.gpus)]
        return {"node": {}, "accelerators": accelerators,
                "models": [dict(m) for m in self.models.values()],
                "cached_artifacts": list(self.cached), "artifacts_staging": list(self.staging)}

    async def fresh_snapshot(self, models: Sequence[str]) -> dict[str, Any]:
        """The snapshot with the named engines read now: ``live`` over the last scrape."""
        body = await self.snapshot()
        self.calls.append(("fresh_snapshot", tuple(models)))
        for entry in body["models"]:
            if entry["model_name"] in models:
                read = self.fresh_answers and entry["phase"] == "active"
                entry.update(self.live.get(entry["model_name"], {}) if read else
                             {"request_metrics_observed": False, "request_success_total": None})
                entry["request_figures_fresh"] = read
        return body

    async def activate(self, spec: ActivateSpec) -> Reply:
        self._check()
        self.calls.append(("activate", spec))
        if self.activate_reply is not None:
            return self.activate_reply
        port = next(_ports)
        self.add(spec.model_name, "booting", claim=(spec.claim_namespace, spec.claim_name),
                 port=port, engine=spec.engine, kv_limit_requested_bytes=spec.kv_limit_bytes,
                 artifact_url=spec.artifact_url)
        return Reply(200, {"status": "success", "model_name": spec.model_name, "port": port,
                           "phase": "booting"})

    async def deactivate(self, model_name: str) -> Reply:
        self._check()
        self.calls.append(("deactivate", model_name))
        self.models.pop(model_name, None)
        return Reply(200, {"status": "success", "model_name": model_name})

    async def sleep(self, model_name: str, level: int = 1) -> Reply:
        self._check()
        self.calls.append(("sleep", model_name, level))
        if model_name in self.sleep_refused:
            return Reply(409, {"status": "error", "reason": "InsufficientHostMemory",
                               "message": f"model {model_name!r} cannot sleep now"})
        self.set(model_name, phase="sleeping", ready=False,
                 sleeping_footprint_bytes=SLEEPING_FOOTPRINT if self.measures_sleep else None)
        return Reply(200, {"status": "success", "applied": True, "phase": "sleeping"})

    async def wake(self, model_name: str) -> Reply:
        self._check()
        self.calls.append(("wake", model_name))
        if self.wake_reply is not None:
            return self.wake_reply
        self.set(model_name, phase="active", ready=True)
        return Reply(200, {"status": "success", "applied": True, "phase": "active"})

    async def kv_limit(self, model_name: str, limit_bytes: int) -> Reply:
        self._check()
        self.calls.append(("kv_limit", model_name, limit_bytes))
        applied = model_name not in self.unconfirmed_kv
        self.set(model_name, kv_limit_requested_bytes=limit_bytes,
                 **({"kv_limit_applied_bytes": limit_bytes} if applied else {}))
        return Reply(200, {"status": "success", "applied": applied,
                           "requested_bytes": limit_bytes,
                           "applied_bytes": limit_bytes if applied else None})

    async def download(self, artifact_url: str) -> Reply:
        self._check()
        self.calls.append(("download", artifact_url))
        self.staging.append(artifact_url)
        return Reply(200, {"status": "success", "started": True, "state": "downloading"})

    # ---- the test's hands ---------------------------------------------------------------------

    def add(self, model: str, phase: str = "active", *, claim: ClaimKey | None = None,
            **fields: Any) -> dict[str, Any]:
        """Put an engine on this agent (``claim``: the claim it answers to)."""
        entry: dict[str, Any] = {
            "model_name": model, "engine": "vllm", "artifact_url": f"huggingface://t/{model}",
            "claim_ref": {"namespace": claim[0], "name": claim[1], "uid": "u"} if claim else None,
            "engine_id": f"id-{model}-{next(_ports)}", "port": next(_ports), "phase": phase,
            "ready": phase == "active", "operation": None, "restart_count": 0,
            "last_error": None, "requests_running": 0.0, "requests_waiting": 0.0,
            "request_success_total": 0.0, "kv_limit_requested_bytes": None,
            "kv_limit_applied_bytes": None, "kv_used_bytes": 0,
            "kv_segment": {"present": phase == "active"}, "conditions": [],
            "hbm_bytes": 1 * GiB, "sleeping_footprint_bytes": None, "devices": [0]}
        entry.update(fields)
        self.models[model] = entry
        return entry

    def set(self, model: str, **fields: Any) -> None:
        self.models[model].update(fields)
        if fields.get("phase") == "active":
            self.models[model].setdefault("ready", True)
            self.models[model]["kv_segment"] = {"present": True}

    def serve(self, model: str, applied: int | None = None) -> None:
        """The engine became ready and holds a KV limit."""
        entry = self.models[model]
        limit = applied or entry.get("kv_limit_requested_bytes") or 1 * GiB
        self.set(model, phase="active", ready=True, kv_limit_applied_bytes=limit,
                 kv_limit_requested_bytes=entry.get("kv_limit_requested_bytes") or limit)


def claim_yaml(name: str, model: str | None = None, footprint: str = "6Gi",
               kv_floor: str = "1Gi", args: Mapping[str, str] | None = None,
               pool: str = "pool-a", engine: str = "vllm", artifact: str | None = None) -> str:
    """A ModelClaim manifest; engine arguments ``args`` over a 2048-token context (not for
    Ollama, which takes no such flag)."""
    merged = {} if engine == "ollama" else {"--max-model-len": "2048"}
    merged.update(args or {})
    lines = ",".join(f'\n      "{k}": "{v}"' for k, v in merged.items())
    return f"""---
apiVersion: model.aibrix.ai/v1alpha1
kind: ModelClaim
metadata:
  name: {name}
  namespace: default
spec:
  modelName: {model or name}
  podSelector:
    matchLabels:
      claim.model.aibrix.ai/pool: {pool}
  artifactURL: {artifact or f"huggingface://t/{model or name}"}
  engine: {engine}
  perGPU:
    maximumFootprint: {footprint}
    kvFloor: {kv_floor}
  engineConfig:
    args: {{{lines}}}
"""


def pool_yaml(agents: list[FakeAgent], policy: str | None = None) -> str:
    listed = "".join(f'\n    - {{name: {a.name}, url: "{a.url}"}}' for a in agents)
    policy_line = f"\n  policy: {policy}" if policy else ""
    return f"""kind: WarmPool
metadata:
  name: pool-a
  labels: {{claim.model.aibrix.ai/pool: pool-a, claim.model.aibrix.ai/enabled: "true"}}
spec:{policy_line}
  agents:{listed}
"""


class Rig:
    """The reconcilers over fake agents, a manifest directory and a fake clock."""

    def __init__(self, directory: Path, agents: list[FakeAgent], claims: str = "",
                 policy: str | None = None, footprints: Path | None = None) -> None:
        self.dir = directory
        self.clock = FakeClock(1000.0)
        self.agents = {a.name: a for a in agents}
        (directory / "pool.yaml").write_text(pool_yaml(agents, policy))
        (directory / "claims.yaml").write_text(claims)
        self.desired = DesiredState(directory, footprints=footprints)
        self.desired.load()
        self.store = StatusStore(None, self.clock.wall)
        tracker = IdleTracker()
        cache = SnapshotCache(self.agents.get, self.clock, on_snapshot=tracker.observe)
        self.kv_kicks: list[str] = []
        self.claim_kicks: list[ClaimKey] = []
        self.deps = Deps.build(self.clock, self.desired,
                               self.store, self.agents.get, cache, tracker=tracker,
                               kick_kv=self.kv_kicks.append, kick_claim=self.claim_kicks.append)
        self.claims = ClaimReconciler(self.deps)
        self.kv = KvReconciler(self.deps)

    def write_claims(self, text: str) -> None:
        path = self.dir / "claims.yaml"
        old = path.read_text()
        path.write_text(text)
        self.desired.on_file(path, old, text)

    async def reconcile(self, name: str, advance: float = 0.2) -> Result:
        """Let the snapshot cache expire (``advance`` seconds), then reconcile ``name``."""
        self.clock.advance(advance)
        return await self.claims.reconcile(("default", name))

    def status(self, name: str) -> ClaimStatus:
        st = self.store.get(("default", name))
        assert st is not None, f"no status for {name}"
        return st

    def events(self, name: str) -> list[str]:
        return [e.reason for e in self.status(name).events]
