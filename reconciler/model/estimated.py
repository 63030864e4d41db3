"""A claim that declares no ``perGPU`` is placed on figures estimated from its artifact, when
the reconciler can read that artifact (a local model directory).

The seed's claim without ``perGPU`` stays Pending with ``InvalidPerGPU``; its other seed
(Kubemoot) says a footprint is "observed first, declared second". Here, in local mode (a
claims directory, where an agent's local paths are the reconciler's too), a claim whose
``spec.perGPU`` is absent and whose ``artifactURL`` is a readable model directory gets the
estimate of ``contract.footprint`` as its figures, marked as estimated (``PerGPU.estimated``
says from what; the status shows it), and no ``InvalidPerGPU``.

Rules:

* A declared ``perGPU`` always wins, and a declared figure that is missing or not positive
  stays ``InvalidPerGPU``: only a claim with no ``perGPU`` at all is estimated.
* An artifact that cannot be read (not staged, another scheme such as ``huggingface://``,
  hostile files) is no reason to wait: the claim is marked ``unmeasured`` (with why the
  estimate failed) and placed to be measured, on GPUs no other engine uses
  (``planning.placement.place_to_measure``). The seed answers ``InvalidPerGPU`` here.
* Once an engine of the same artifact and engine arguments ran, its measured footprint
  (``reconciler.footprints``) replaces the estimated one; the KV floor stays the formula's. An
  artifact that cannot be read has no formula: its KV floor is assumed (``ASSUMED_KV_FLOOR``,
  the seed's samples' 1 GiB), and its ``estimated`` text says so and how to declare it.
* Ollama claims are not estimated (Ollama pulls its own files, and its engines report no KV
  cache in use to measure against): without perGPU they stay ``InvalidPerGPU``.
* Kubernetes mode reads no artifact (``read=False``): the reconciler's Pod does not hold the
  agents' files, so a path in a claim names nothing it can read (and reading it would probe
  its own disk). Every claim without perGPU there is placed to be measured, and its
  measurement is kept in memory (a restarted reconciler measures its running engines again).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from contract.engines import is_local_artifact
from contract.quantity import GiB, gib
from contract.footprint.estimate import FootprintError
from contract.footprint.reading import estimate_artifact
from contract.reasons import INVALID_PER_GPU
from reconciler.model.manifests import (
    CLAIM_KIND,
    PER_GPU_MISSING,
    ModelClaim,
    ParseResult,
    PerGPU,
    Problem,
)


Measured = Callable[[str, Mapping[str, str]], "tuple[int, str] | None"]
ASSUMED_KV_FLOOR = 1 * GiB  # for a measured claim whose artifact has no readable config


def _none(artifact: str, args: Mapping[str, str]) -> tuple[int, str] | None:
    return None


NOT_READ = ("on Kubernetes the reconciler reads no artifact: its Pod does not hold the "
            "agents' files")


def with_estimate(claim: ModelClaim, measured: Measured = _none, *,
                  read: bool = True) -> ModelClaim:
    """``claim`` with estimated figures when it declares no perGPU and its artifact can be
    read; with measured figures when it cannot but an engine of it was measured; else marked
    ``unmeasured`` (saying why no estimate was made). ``measured``: the footprint an engine of
    the same artifact and arguments was measured at (``reconciler.footprints``), which
    replaces the estimate's."""
    missing = [p for p in claim.problems
               if p.reason == INVALID_PER_GPU and p.message == PER_GPU_MISSING]
    if claim.per_gpu is not None or not missing or claim.engine == "ollama":
        return claim
    args: Mapping[str, str] = claim.engine_args
    try:
        if not read:
            raise FootprintError(NOT_READ)
        if not is_local_artifact(claim.artifact_url):
            raise FootprintError(f"{claim.artifact_url} is not a local directory this "
                                 "reconciler can read")
        got = estimate_artifact(claim.artifact_url, args)
    except FootprintError as exc:
        rest = tuple(p for p in claim.problems if p is not missing[0])
        seen = measured(claim.artifact_url, args)
        if seen is None:
            return replace(claim, problems=rest, unmeasured=str(exc))
        source = (f"{seen[1]}; KV floor assumed {gib(ASSUMED_KV_FLOOR)}, since the artifact "
                  f"could not be read ({exc}): declare spec.perGPU to set it")
        return replace(claim, problems=rest,
                       per_gpu=PerGPU(seen[0], ASSUMED_KV_FLOOR, estimated=source))
    source = (f"estimated from {claim.artifact_url}: weights {got.weights.source}; "
              f"KV floor {got.kv_floor.source}")
    footprint = got.footprint.bytes
    seen = measured(claim.artifact_url, args)
    if seen is not None:
        footprint, source = seen[0], f"{seen[1]}; KV floor {got.kv_floor.source}"
    per_gpu = PerGPU(footprint, got.kv_floor.bytes, estimated=source)
    return replace(claim, per_gpu=per_gpu,
                   problems=tuple(p for p in claim.problems if p is not missing[0]))


def re_estimate(claim: ModelClaim, measured: Measured = _none, *,
                read: bool = True) -> ModelClaim:
    """``claim``'s figures made again when they were not declared (estimated, measured or
    unmeasured): for a running version kept over an edit (``model.changes``), whose figures
    must be its own artifact's and arguments', not the edited version's."""
    if not claim.figures_found:
        return claim
    missing = Problem(CLAIM_KIND, claim.name, INVALID_PER_GPU, PER_GPU_MISSING, claim.namespace)
    return with_estimate(replace(claim, per_gpu=None, unmeasured="",
                                 problems=(*claim.problems, missing)), measured, read=read)


def with_estimates(result: ParseResult, measured: Measured = _none) -> ParseResult:
    """``result`` with every claim passed through ``with_estimate``, its problems list kept in
    step (an estimated, measured or unmeasured claim's InvalidPerGPU gone)."""
    claims = tuple(with_estimate(c, measured) for c in result.claims)
    if claims == result.claims:
        return result
    swap: dict[Problem, Problem | None] = {}
    for old, new in zip(result.claims, claims):
        came = [p for p in new.problems if p not in old.problems]
        for gone in (p for p in old.problems if p not in new.problems):
            swap[gone] = came[0] if came else None
    problems = tuple(q for p in result.problems if (q := swap.get(p, p)) is not None)
    return replace(result, claims=claims, problems=problems)
