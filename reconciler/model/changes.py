"""Which version of a claim runs: the rule for a change, shared by both run modes.

The guide: only ``perGPU`` may change after a claim is created; anything else is
delete-and-recreate. This project lets ``replicas`` change too (issue 25: a claim scales from
one engine to several and back; the seed says it must be 1). The CRD enforces it with CEL
transition rules, and a manifest directory cannot, so both modes take every new version
through ``take_change``: a change that touches nothing but ``perGPU`` takes effect; any other
keeps the running spec (with the new perGPU, if that changed too, and its labels and own sleep
policy, which are metadata) and says why, so the edit is refused visibly instead of silently
ignored.

A version that cannot be read at all (broken YAML, a file caught half-written, a directory
gone) never replaces a good one: ``unreadable`` keeps the last good version with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from reconciler.model.manifests import CLAIM_KIND, ModelClaim, Problem

IMMUTABLE_FIELD_CHANGED = "ImmutableFieldChanged"

# (spec field, how ModelClaim holds it)
_IMMUTABLE = (("modelName", "model_name"), ("podSelector", "pod_selector"),
              ("artifactURL", "artifact_url"), ("engine", "engine"),
              ("engineConfig", "engine_args"))


@dataclass(frozen=True)
class Taken:
    """The version that runs, and the problem with the declared one (None: it runs as declared)."""

    claim: ModelClaim
    problem: Problem | None = None


def changed_fields(old: ModelClaim, new: ModelClaim) -> list[str]:
    """The immutable spec fields whose values differ (``spec.engineConfig``, ...)."""
    return [f"spec.{name}" for name, attr in _IMMUTABLE
            if getattr(old, attr) != getattr(new, attr)]


def take_change(running: ModelClaim | None, declared: ModelClaim) -> Taken:
    """The version to run when ``declared`` replaces ``running`` (None: a new claim)."""
    if running is None:
        return Taken(declared)
    fields = changed_fields(running, declared)
    if not fields:
        return Taken(declared)
    per_gpu_problems = tuple(p for p in declared.problems if p.reason != "InvalidEngineConfig")
    kept = replace(running, per_gpu=declared.per_gpu, unmeasured=declared.unmeasured,
                   replicas=declared.replicas, min_replicas=declared.min_replicas,
                   max_replicas=declared.max_replicas, lifecycle=declared.lifecycle,
                   lifecycle_problem=declared.lifecycle_problem, labels=declared.labels,
                   problems=tuple(p for p in running.problems if p.reason == "InvalidEngineConfig")
                   + tuple(p for p in per_gpu_problems if p.reason == "InvalidPerGPU"))
    message = (f"{', '.join(fields)} cannot change after a claim is created (only spec.perGPU "
               "can); the claim keeps running as it was created: delete it and create it again "
               "to apply the change")
    return Taken(kept, Problem(CLAIM_KIND, declared.name, IMMUTABLE_FIELD_CHANGED, message,
                               declared.namespace))


def unreadable(running: ModelClaim, reason: str, message: str) -> Taken:
    """The declared version cannot be read: keep ``running``, and say why."""
    return Taken(running, Problem(CLAIM_KIND, running.name, reason,
                                  f"{message}; the claim keeps its last good version",
                                  running.namespace))
