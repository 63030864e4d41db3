"""Claim status and events: what the reconciler reports for each claim, kept on disk.

A ``ClaimStatus`` holds a claim's phase (Pending, Activating, Active, Sleeping, Failed), its
``Scheduled`` and ``Ready`` conditions with the guide's reasons, its ``instances`` (agent, port,
KV limit) and its last events (bounded; a repeat of the latest event only counts up, as
Kubernetes aggregates them). The reconcilers change statuses in place, on the event loop and
without an await between a read and its change; every change calls ``notify``, with which the
``StatusStore`` (``reconciler.store``) marks the claim dirty and writes it to disk.

The JSON is shaped like the Kubernetes object (``metadata``, ``spec``, ``status``, ``events``),
which is what ``GET /v1/claims/{ns}/{name}`` serves.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from reconciler.desired import ClaimKey
from reconciler.model.claim_lifecycle import INVALID_LIFECYCLE
from reconciler.model.manifests import API_VERSION, CLAIM_KIND, ModelClaim
from reconciler.replicas import index_of, ready_count, split, summary_phase

log = logging.getLogger("reconciler.status")

PENDING, ACTIVATING, ACTIVE, SLEEPING, FAILED = "Pending", "Activating", "Active", "Sleeping", \
    "Failed"
SCHEDULED, READY, SPEC_APPLIED = "Scheduled", "Ready", "SpecApplied"
LIFECYCLE_APPLIED = "LifecycleApplied"  # only on a claim with its own sleep policy
# Scheduled reasons
PLACED, NO_MATCHING_PODS, TOO_LARGE, INVALID_PER_GPU, MAKING_ROOM = (
    "Placed", "NoMatchingPods", "TooLargeForAnyCard", "InvalidPerGPU", "MakingRoom")
# Ready reasons
MODEL_CLAIM_ACTIVE, ENGINE_STARTING, ENGINE_SLEEPING, WAITING_FOR_ROOM, MOVING = (
    "ModelClaimActive", "EngineStarting", "EngineSleeping", "WaitingForRoom", "Moving")
ENGINE_FAILED, ACTIVATE_FAILED, INVALID_ENGINE_CONFIG, NOT_PLACED = (
    "EngineFailed", "ActivateFailed", "InvalidEngineConfig", "NotPlaced")
MAX_EVENTS = 50


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def _ts(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass
class Condition:
    type: str
    status: str  # "True" | "False"
    reason: str
    message: str
    since: float  # wall time of the last change of status or reason

    def as_json(self) -> dict[str, Any]:
        return {"type": self.type, "status": self.status, "reason": self.reason,
                "message": self.message, "lastTransitionTime": iso(self.since)}


@dataclass
class ClaimEvent:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str
    first: float
    last: float
    count: int = 1

    def as_json(self) -> dict[str, Any]:
        return {"type": self.type, "reason": self.reason, "message": self.message,
                "firstTimestamp": iso(self.first), "lastTimestamp": iso(self.last),
                "count": self.count}


@dataclass
class Instance:
    agent: str
    port: int = 0
    kv_limit_bytes: int | None = None
    devices: tuple[int, ...] = ()
    moving: bool = False  # the engine a make-before-break move brings up (``reconciler.moving``)

    def as_json(self) -> dict[str, Any]:
        # on Kubernetes an agent is named <namespace>/<pod>; the guide reads the Pod's name
        out = {"agent": self.agent, "pod": self.agent.rpartition("/")[2], "port": self.port,
               "kvLimitBytes": self.kv_limit_bytes, "devices": list(self.devices)}
        return {**out, "moving": True} if self.moving else out


@dataclass
class ClaimStatus:
    """One claim's status. Change it only through its methods: each marks it dirty."""

    namespace: str
    name: str
    uid: str
    created: float
    model_name: str = ""
    engine: str = "vllm"
    artifact_url: str = ""
    per_gpu: tuple[int, int] | None = None  # (maximumFootprint, kvFloor) bytes, last valid
    phase: str = PENDING
    conditions: dict[str, Condition] = field(default_factory=dict)
    instances: list[Instance] = field(default_factory=list)
    events: deque[ClaimEvent] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    deleted: float | None = None
    not_ready_since: float | None = None
    attempts: int = 0  # placement tries since the claim was last placed
    observed_generation: int | None = None  # the claim's generation the status reflects
    per_gpu_estimated: str = ""  # what per_gpu was estimated from; empty: declared
    desired_replicas: int = 1  # spec.replicas (``reconciler.replicas``)
    # the statuses of replicas 1.. (the store links them; replica 0 is this one)
    replicas: Callable[[], list[ClaimStatus]] = field(default=lambda: [], repr=False,
                                                       compare=False)
    notify: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)
    on_event: Callable[[ClaimEvent], None] = field(default=lambda event: None, repr=False,
                                                   compare=False)

    @property
    def key(self) -> ClaimKey:
        return (self.namespace, self.name)

    @property
    def instance(self) -> Instance | None:
        return self.instances[0] if self.instances else None

    @property
    def index(self) -> int:
        """The replica this status is for (0: the claim itself)."""
        return index_of(self.key)

    @property
    def claim_name(self) -> str:
        """The claim's name (a replica's status is named ``name#i``)."""
        return split(self.name)[0]

    def reason(self, kind: str) -> str:
        cond = self.conditions.get(kind)
        return cond.reason if cond else ""

    # ---- changes ----------------------------------------------------------------------------

    def set_spec(self, claim: ModelClaim) -> None:
        per_gpu = (claim.per_gpu.maximum_footprint, claim.per_gpu.kv_floor) \
            if claim.per_gpu else self.per_gpu
        estimated = claim.per_gpu.estimated if claim.per_gpu else self.per_gpu_estimated
        spec = (claim.model_name, claim.engine, claim.artifact_url, per_gpu, estimated,
                claim.replicas)
        if spec != (self.model_name, self.engine, self.artifact_url, self.per_gpu,
                    self.per_gpu_estimated, self.desired_replicas):
            (self.model_name, self.engine, self.artifact_url, self.per_gpu,
             self.per_gpu_estimated, self.desired_replicas) = spec
            self.notify()

    def set(self, now: float, phase: str, *, scheduled: tuple[bool, str, str] | None = None,
            ready: tuple[bool, str, str]) -> None:
        """Phase and conditions at once: ``(ok, reason, message)`` for each condition."""
        changed = phase != self.phase
        self.phase = phase
        if scheduled is not None:
            changed |= self._condition(now, SCHEDULED, *scheduled)
        changed |= self._condition(now, READY, *ready)
        is_ready = ready[0]
        if is_ready and self.not_ready_since is not None:
            self.not_ready_since, changed = None, True
        elif not is_ready and self.not_ready_since is None:
            self.not_ready_since, changed = now, True
        if changed:
            self.notify()

    def set_spec_problem(self, now: float, reason: str | None, message: str = "") -> None:
        """The ``SpecApplied`` condition: False with the reason while the declared spec is not
        the one that runs (an edit of an immutable field, an unreadable manifest), with a
        Warning event when the problem first appears; True once it runs as declared."""
        old = self.conditions.get(SPEC_APPLIED)
        if reason is None:
            if old is not None and self._condition(now, SPEC_APPLIED, True, "Applied",
                                                   "the claim runs as declared"):
                self.notify()
            return
        if old is None or (old.status, old.reason, old.message) != ("False", reason, message):
            self.event(now, reason, message, warning=True)
        if self._condition(now, SPEC_APPLIED, False, reason, message):
            self.notify()

    def set_lifecycle(self, now: float, declared: bool, problem: str | None) -> None:
        """The ``LifecycleApplied`` condition of a claim with its own sleep policy (the
        ``claim_lifecycle`` annotation): True while it applies, False with ``InvalidLifecycle``
        (and a Warning event when that first appears) while the pool's applies instead; gone
        with the annotation."""
        old = self.conditions.get(LIFECYCLE_APPLIED)
        if not declared:
            if old is not None:
                del self.conditions[LIFECYCLE_APPLIED]
                self.notify()
            return
        if problem is None:
            changed = self._condition(now, LIFECYCLE_APPLIED, True, "Applied",
                                      "the claim's own sleep policy applies")
        else:
            if old is None or (old.status, old.message) != ("False", problem):
                self.event(now, INVALID_LIFECYCLE, problem, warning=True)
            changed = self._condition(now, LIFECYCLE_APPLIED, False, INVALID_LIFECYCLE, problem)
        if changed:
            self.notify()

    def set_scheduled(self, now: float, ok: bool, reason: str, message: str) -> None:
        if self._condition(now, SCHEDULED, ok, reason, message):
            self.notify()

    def _condition(self, now: float, kind: str, ok: bool, reason: str, message: str) -> bool:
        status = "True" if ok else "False"
        old = self.conditions.get(kind)
        if old is not None and (old.status, old.reason, old.message) == (status, reason, message):
            return False
        since = old.since if old is not None and (old.status, old.reason) == (status, reason) \
            else now
        self.conditions[kind] = Condition(kind, status, reason, message, since)
        return True

    def set_instance(self, agent: str | None, port: int = 0,
                     devices: tuple[int, ...] = ()) -> None:
        """The claim's engine is on ``agent`` (None: nowhere); keeps a known KV limit, and the
        engine a move brings up elsewhere (``set_moving``) while there is one."""
        if agent is None:
            new: list[Instance] = []
        else:
            old = self.instance
            kv = old.kv_limit_bytes if old is not None and old.agent == agent else None
            new = [Instance(agent, port, kv, devices or (old.devices if old else ())),
                   *(i for i in self.instances[1:] if i.moving and i.agent != agent)]
        if new != self.instances:
            self.instances = new
            self.notify()

    def set_moving(self, agent: str | None, port: int = 0,
                   devices: tuple[int, ...] = ()) -> None:
        """The engine a make-before-break move brings up on ``agent`` (None: no move), listed
        after the claim's own while the claim's engine still serves."""
        new = [*self.instances[:1], *([Instance(agent, port, None, devices, moving=True)]
                                      if agent is not None and self.instances else [])]
        if new != self.instances:
            self.instances = new
            self.notify()

    def set_kv_limit(self, agent: str, limit: int | None) -> None:
        inst = self.instance
        if inst is not None and inst.agent == agent and inst.kv_limit_bytes != limit:
            inst.kv_limit_bytes = limit
            self.notify()

    def set_attempts(self, attempts: int) -> None:
        if attempts != self.attempts:
            self.attempts = attempts
            self.notify()

    def mark_deleted(self, now: float) -> None:
        if self.deleted is None:
            self.deleted = now
            self.notify()

    def event(self, now: float, reason: str, message: str, warning: bool = False) -> None:
        kind = "Warning" if warning else "Normal"
        last = self.events[-1] if self.events else None
        if last is not None and (last.type, last.reason, last.message) == (kind, reason, message):
            last.count += 1
            last.last = now
        else:
            self.events.append(ClaimEvent(kind, reason, message, now, now))
        self.on_event(self.events[-1])
        log.info("claim %s/%s: %s: %s", self.namespace, self.name, reason, message,
                 extra={"claim": f"{self.namespace}/{self.name}", "reason": reason})
        self.notify()

    # ---- JSON -------------------------------------------------------------------------------

    def _members(self) -> list[ClaimStatus]:
        """This status and its replicas' (none for a one-replica claim)."""
        return [self, *self.replicas()]

    def summary(self) -> tuple[str, int, list[dict[str, Any]], dict[str, Condition]]:
        """(phase, readyReplicas, instances, conditions) as the claim reports them: for one
        replica its own; for several, summarised (``reconciler.replicas``), each replica an
        instance with its ``index`` and ``phase``."""
        members = self._members()
        if self.desired_replicas <= 1 and len(members) == 1:
            return (self.phase, 1 if self.phase == ACTIVE else 0,
                    [i.as_json() for i in self.instances], self.conditions)
        phases = [m.phase for m in members]
        instances = [{**i.as_json(), "index": m.index, "phase": m.phase}
                     for m in members for i in m.instances]
        ready = ready_count(phases)
        conditions = dict(self.conditions)
        serving = next((m for m in members if m.phase == ACTIVE), None)
        own = self.conditions.get(READY)
        if serving is not None and (own is None or own.status != "True"):
            cond = serving.conditions.get(READY)
            if cond is not None:
                conditions[READY] = Condition(READY, cond.status, cond.reason,
                                              f"replica {serving.index}: {cond.message}",
                                              cond.since)
        if own is not None and conditions.get(READY) is not None:
            cond = conditions[READY]
            conditions[READY] = Condition(READY, cond.status, cond.reason,
                                          f"{ready} of {self.desired_replicas} replicas ready; "
                                          f"{cond.message}", cond.since)
        return summary_phase(phases), ready, instances, conditions

    def _events_json(self) -> list[dict[str, Any]]:
        """The claim's events, and its replicas' (named so in their message), oldest first."""
        out = [e.as_json() for e in self.events]
        others = self.replicas()
        if not others:
            return out
        for st in others:
            out += [{**e.as_json(), "message": f"replica {st.index}: {e.message}",
                     "replica": st.index} for e in st.events]  # read back by its own file
        return sorted(out, key=lambda e: e["lastTimestamp"] or "")

    def as_json(self) -> dict[str, Any]:
        phase, ready, instances, conditions = self.summary()
        spec: dict[str, Any] = {"modelName": self.model_name, "engine": self.engine,
                                "artifactURL": self.artifact_url,
                                "replicas": self.desired_replicas}
        if self.per_gpu is not None:
            spec["perGPU"] = {"maximumFootprint": self.per_gpu[0], "kvFloor": self.per_gpu[1]}
            if self.per_gpu_estimated:  # not declared: the artifact's estimate, and from what
                spec["perGPU"]["estimated"] = self.per_gpu_estimated
        return {
            "apiVersion": API_VERSION, "kind": CLAIM_KIND,
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid,
                         "creationTimestamp": iso(self.created),
                         "deletionTimestamp": iso(self.deleted)},
            "spec": spec,
            "status": {"phase": phase, "desiredReplicas": self.desired_replicas,
                       "readyReplicas": ready,
                       "conditions": [conditions[k].as_json()
                                      for k in (SCHEDULED, READY, SPEC_APPLIED,
                                                LIFECYCLE_APPLIED)
                                      if k in conditions],
                       "instances": instances,
                       "notReadySince": iso(None if ready else self.not_ready_since),
                       "placementAttempts": self.attempts},
            "events": self._events_json(),
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ClaimStatus:
        meta, spec, st = doc["metadata"], doc.get("spec") or {}, doc.get("status") or {}
        per_gpu = spec.get("perGPU")
        out = cls(str(meta["namespace"]), str(meta["name"]), str(meta.get("uid") or uuid.uuid4()),
                  _ts(meta.get("creationTimestamp")) or 0.0, str(spec.get("modelName", "")),
                  str(spec.get("engine", "vllm")), str(spec.get("artifactURL", "")),
                  (int(per_gpu["maximumFootprint"]), int(per_gpu["kvFloor"]))
                  if isinstance(per_gpu, dict) else None,
                  str(st.get("phase", PENDING)))
        for c in st.get("conditions") or ():
            out.conditions[c["type"]] = Condition(c["type"], c["status"], c["reason"],
                                                  c.get("message", ""),
                                                  _ts(c.get("lastTransitionTime")) or 0.0)
        own = [i for i in st.get("instances") or ()
               if int(i.get("index") or 0) == out.index]  # others: other replicas'
        out.instances = [Instance(str(i["agent"]), int(i.get("port") or 0), i.get("kvLimitBytes"),
                                  tuple(i.get("devices") or ()), bool(i.get("moving")))
                         for i in own]
        out.desired_replicas = int(spec.get("replicas") or 1)
        if own and "index" in own[0] and isinstance(own[0].get("phase"), str):
            out.phase = own[0]["phase"]  # the claim's phase is the replicas' summary
        for e in doc.get("events") or ():
            if e.get("replica"):
                continue  # a replica's, kept in its own status
            out.events.append(ClaimEvent(e["type"], e["reason"], e["message"],
                                         _ts(e.get("firstTimestamp")) or 0.0,
                                         _ts(e.get("lastTimestamp")) or 0.0,
                                         int(e.get("count", 1))))
        if isinstance(per_gpu, dict) and isinstance(per_gpu.get("estimated"), str):
            out.per_gpu_estimated = per_gpu["estimated"]
        out.deleted = _ts(meta.get("deletionTimestamp"))
        out.not_ready_since = _ts(st.get("notReadySince"))
        out.attempts = int(st.get("placementAttempts") or 0)
        return out
