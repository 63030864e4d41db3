"""ModelClaims and warm pools from YAML text (one or many documents), reported per object.

Parsing never raises for bad content. ``parse_manifests`` returns a ``ParseResult``:

* ``claims``: every ModelClaim that parsed. A claim whose ``perGPU`` is unusable
  (``InvalidPerGPU``: it stays Pending) or whose engine arguments are invalid
  (``InvalidEngineConfig``: it reads Failed) is still a claim, since it has a status and its
  model a gateway answer; it carries those problems in ``claim.problems`` and
  ``claim.hold_reason`` says what holds it back. ``ParseResult.placeable_claims`` leaves them out.
* ``pools``: every pool, from our own ``kind: WarmPool`` or from the guide's warm-pool
  Deployment (a Deployment labelled ``claim.model.aibrix.ai/pool``) when its agents' URLs are
  given separately. An invalid pool policy turns the policy off (``InvalidPoolPolicy``) and
  keeps the pool.
* ``problems``: one ``Problem(kind, name, reason, message)`` per invalid object (also the held
  claims' and invalid policies'). An object with a structural problem (bad YAML, a missing
  required field, ``replicas`` outside 1..8, a name over 63 characters, a duplicate) is left out.
* ``ignored``: other kinds (the pool's metrics Service, say), as ``Kind/name``.

Our pool format (``apiVersion`` is optional)::

    kind: WarmPool
    metadata:
      name: pool-a
      namespace: default            # the default
      labels:                       # every agent of the pool carries these labels
        claim.model.aibrix.ai/pool: pool-a
        claim.model.aibrix.ai/enabled: "true"
    spec:
      policy: {"lifecycle": {"sleepAfterSeconds": 300}}   # an object, or its JSON text
      agents:
        - name: agent-a
          url: http://10.0.0.5:8080
          labels: {zone: a}         # added to the pool's labels

The policy may instead be the ``claim.model.aibrix.ai/pool-policy`` annotation, as on a
Deployment (not both).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, cast

import yaml  # type: ignore[import-untyped]
from pydantic import ValidationError

from contract.engines import gpus_needed
from contract.engines import engine_args_problem as contract_args_problem
from contract.names import model_name_problem as contract_model_name_problem
from contract.quantity import QuantityError, parse_quantity
from contract.reasons import INVALID_ENGINE_CONFIG, INVALID_PER_GPU
from reconciler.model.claim_lifecycle import ClaimLifecycle, lifecycle_of
from reconciler.model.policy import (
    INVALID_POOL_POLICY,
    POLICY_ANNOTATION,
    POLICY_OFF,
    PoolPolicy,
    parse_pool_policy,
)
from reconciler.model.claim_schema import (
    DNS_LABEL_PATTERN,
    ClaimSpec,
    Engine,
    ObjectMeta,
    PerGPUSpec,
    PoolSpec,
    describe,
    LABELS,
)
from reconciler.model.selector import LabelSelector, selector_from
from reconciler.replicas import MAX_REPLICAS, route_name

API_VERSION = "model.aibrix.ai/v1alpha1"
CLAIM_KIND = "ModelClaim"
POOL_KIND = "WarmPool"
ROUTE_KIND = "ModelRoute"  # parsed by ``reconciler.selection.route_spec`` (both modes)
POOL_LABEL = "claim.model.aibrix.ai/pool"
ENABLED_LABEL = "claim.model.aibrix.ai/enabled"
# ours: a Pod (agent) whose claims move away, make before break (``reconciler.moving``)
DRAINING_LABEL = "claim.model.aibrix.ai/draining"
GPU_RESOURCE = "nvidia.com/gpu"
MAX_CLAIM_NAME = 63


# Reasons. The first two are the guide's; the rest name what is wrong with a manifest.
INVALID_YAML = "InvalidYAML"
INVALID_MANIFEST = "InvalidManifest"
INVALID_SPEC = "InvalidSpec"
INVALID_NAME = "InvalidName"
INVALID_REPLICAS = "InvalidReplicas"
DUPLICATE = "Duplicate"
NO_AGENTS = "NoAgents"

_DNS_LABEL = re.compile(DNS_LABEL_PATTERN)
_SEPARATOR = re.compile(r"^(---|\.\.\.)(\s.*)?$")


@dataclass(frozen=True)
class Problem:
    """Why one object is invalid. ``source``: where it came from, ``file#document``."""

    kind: str
    name: str
    reason: str
    message: str
    namespace: str = ""
    source: str = ""

    def __str__(self) -> str:
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        at = f" ({self.source})" if self.source else ""
        return f"{self.kind} {where}{at}: {self.reason}: {self.message}"


@dataclass(frozen=True)
class PerGPU:
    """What one instance needs on each of its GPUs, in bytes."""

    maximum_footprint: int
    kv_floor: int
    # Empty: declared in the claim. Otherwise what the figures were estimated from (the
    # artifact's files, ``reconciler.model.estimated``); a declared perGPU always wins.
    estimated: str = ""

    @property
    def room(self) -> int:
        """What placement looks for on a GPU: the footprint plus the KV floor."""
        return self.maximum_footprint + self.kv_floor


def _frozen(m: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(m))


@dataclass(frozen=True)
class ModelClaim:
    name: str
    namespace: str
    model_name: str
    pod_selector: LabelSelector
    artifact_url: str
    engine: Engine = "vllm"
    # Engines it runs now: spec.replicas, or with a range (``spec.maxReplicas`` above it) the
    # count copies by demand chose in [min_replicas, max_replicas] (``planning.scaling``).
    replicas: int = 1
    per_gpu: PerGPU | None = None
    engine_args: Mapping[str, str] = field(default_factory=dict, hash=False)
    # InvalidPerGPU and InvalidEngineConfig problems: they hold the claim back.
    problems: tuple[Problem, ...] = ()
    # Its own sleep policy (``claim_lifecycle``); why its annotation was ignored, if it was.
    lifecycle: ClaimLifecycle | None = None
    lifecycle_problem: str | None = None
    # What its model is (``metadata.labels``, an open vocabulary: ``family``, ``params``,
    # ``capability/<name>``...), for the routes that choose among claims (issue 24).
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    # Not empty: no perGPU, and why no estimate could be made (``reconciler.model.estimated``);
    # the claim is placed to be measured (``planning.placement.place_to_measure``).
    unmeasured: str = ""
    min_replicas: int = 0  # spec.replicas (0: ``replicas``)
    max_replicas: int = 0  # spec.maxReplicas (0: no range)

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_args", _frozen(self.engine_args))
        object.__setattr__(self, "labels", _frozen(self.labels))

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def replica_range(self) -> tuple[int, int] | None:
        """(fewest, most) engines, for a claim with copies by demand; None without a range."""
        low = self.min_replicas or self.replicas
        return (low, self.max_replicas) if self.max_replicas > low else None

    @property
    def to_measure(self) -> bool:
        """No figures, declared or estimated: placed to be measured."""
        return self.per_gpu is None and bool(self.unmeasured)

    @property
    def figures_found(self) -> bool:
        """Its figures are the reconciler's to find (estimated, measured, or to be measured),
        not declared."""
        return self.to_measure or (self.per_gpu is not None and bool(self.per_gpu.estimated))

    @property
    def route_name(self) -> str:
        """What route holds, in-flight counts and wake requests call this claim's engine: the
        model name, or ``model#i`` for replica ``i`` >= 1 (``reconciler.replicas``)."""
        return route_name(self.model_name, (self.namespace, self.name))

    @property
    def hold_reason(self) -> str | None:
        """InvalidEngineConfig (Failed, recreate the claim), InvalidPerGPU (Pending), or None."""
        reasons = {p.reason for p in self.problems}
        for reason in (INVALID_ENGINE_CONFIG, INVALID_PER_GPU):
            if reason in reasons:
                return reason
        return None

    @property
    def gpus_needed(self) -> int:
        """GPUs one engine uses: tensor x pipeline parallel size (1 for Ollama)."""
        return gpus_needed(self.engine, self.engine_args)


@dataclass(frozen=True)
class AgentRef:
    """A runtime agent: one warm-pool Pod. ``labels`` are the Pod's (the pool's and its own)."""

    name: str
    url: str
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _frozen(self.labels))


@dataclass(frozen=True)
class WarmPool:
    name: str
    namespace: str
    agents: tuple[AgentRef, ...]
    policy: PoolPolicy = POLICY_OFF
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    # Why the written policy was turned off (InvalidPoolPolicy), or None when it is valid.
    policy_problem: str | None = None
    gpus_per_agent: int | None = None  # from a Deployment's nvidia.com/gpu
    source_kind: str = POOL_KIND  # WarmPool or Deployment

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _frozen(self.labels))

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def policy_valid(self) -> bool:
        return self.policy_problem is None


@dataclass(frozen=True)
class RouteDocument:
    """A ``ModelRoute`` as written, with where it came from: the selection package parses it
    (this module sits below it and must not import it)."""

    name: str
    namespace: str
    source: str
    obj: Mapping[str, Any] = field(hash=False, compare=False)


@dataclass(frozen=True)
class ParseResult:
    claims: tuple[ModelClaim, ...] = ()
    pools: tuple[WarmPool, ...] = ()
    problems: tuple[Problem, ...] = ()
    ignored: tuple[str, ...] = ()
    routes: tuple[RouteDocument, ...] = ()

    @property
    def placeable_claims(self) -> tuple[ModelClaim, ...]:
        return tuple(c for c in self.claims if not c.problems)

    @property
    def ok(self) -> bool:
        return not self.problems


class ManifestError(Exception):
    """An object that cannot be taken at all: ``reason`` and ``message`` become its Problem."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# ---- documents ------------------------------------------------------------------------------


def split_documents(text: str) -> list[tuple[int, str]]:
    """The documents of a YAML stream with the line each starts on (0-based), split on ``---``
    and ``...`` lines, so one broken document does not hide the others."""
    docs: list[tuple[int, str]] = []
    start, lines = 0, list[str]()
    for number, line in enumerate(text.splitlines()):
        if _SEPARATOR.match(line):
            docs.append((start, "\n".join(lines)))
            start, lines = number + 1, list[str]()
            rest = line[3:].strip()
            if line.startswith("---") and rest and not rest.startswith("#"):
                lines.append(rest)  # "--- {a: 1}": content on the separator line
        else:
            lines.append(line)
    docs.append((start, "\n".join(lines)))
    return docs


def parse_manifests(text: str, source: str = "<manifest>", *,
                    deployment_agents: Mapping[str, Sequence[AgentRef]] | None = None
                    ) -> ParseResult:
    """Every ModelClaim and pool in ``text``, and a problem for each invalid object.

    ``deployment_agents``: the agents of each warm-pool Deployment, by ``namespace/name`` or
    ``name``; a Deployment's Pods carry its template labels, which are merged into each
    agent's labels."""
    return parse_sources([(source, text)], deployment_agents=deployment_agents)


def parse_sources(sources: Iterable[tuple[str, str]], *,
                  deployment_agents: Mapping[str, Sequence[AgentRef]] | None = None
                  ) -> ParseResult:
    """``parse_manifests`` over several texts (``(source, text)``), duplicates checked across
    all of them."""
    builder = _Builder(deployment_agents or {})
    for source, text in sources:
        for start, chunk in split_documents(text):
            builder.document(source, start, chunk)
    return builder.result()


class _Builder:
    def __init__(self, deployment_agents: Mapping[str, Sequence[AgentRef]]) -> None:
        self.deployment_agents = deployment_agents
        self.claims: list[ModelClaim] = []
        self.pools: list[WarmPool] = []
        self.problems: list[Problem] = []
        self.ignored: list[str] = []
        self.routes: list[RouteDocument] = []
        self.claim_keys: set[str] = set()
        self.model_names: dict[str, str] = {}
        self.pool_keys: set[str] = set()
        self.agent_names: dict[str, str] = {}

    def result(self) -> ParseResult:
        return ParseResult(tuple(self.claims), tuple(self.pools), tuple(self.problems),
                           tuple(self.ignored), tuple(self.routes))

    def document(self, source: str, start: int, chunk: str) -> None:
        where = f"{source}#line{start + 1}"
        try:
            obj = yaml.safe_load(chunk)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f"line {start + mark.line + 1}: " if mark is not None else ""
            detail = getattr(exc, "problem", None) or str(exc)
            self.problems.append(Problem("Document", where, INVALID_YAML, f"{line}{detail}",
                                         source=where))
            return
        if obj is None:
            return
        if not isinstance(obj, Mapping):
            self.problems.append(Problem("Document", where, INVALID_MANIFEST,
                                         "a manifest must be a mapping with kind and metadata",
                                         source=where))
            return
        kind = obj.get("kind")
        meta = obj.get("metadata")
        name = meta.get("name") if isinstance(meta, Mapping) else None
        label = name if isinstance(name, str) and name else where
        namespace = meta.get("namespace", "default") if isinstance(meta, Mapping) else "default"
        namespace = namespace if isinstance(namespace, str) and namespace else "default"
        if kind == CLAIM_KIND:
            self._claim(obj, label, namespace, where)
        elif kind == POOL_KIND:
            self._pool(obj, label, namespace, where)
        elif kind == ROUTE_KIND:
            self.routes.append(RouteDocument(label, namespace, where, obj))
        elif kind == "Deployment" and isinstance(meta, Mapping) and isinstance(
                meta.get("labels"), Mapping) and POOL_LABEL in meta["labels"]:
            self._deployment(obj, label, namespace, where)
        elif isinstance(kind, str) and kind:
            self.ignored.append(f"{kind}/{label}")
        else:
            self.problems.append(Problem("Document", label, INVALID_MANIFEST,
                                         "the manifest has no kind", namespace, where))

    def _claim(self, obj: Mapping[str, Any], label: str, namespace: str, where: str) -> None:
        try:
            claim = claim_from_object(obj)
        except ManifestError as bad:
            self.problems.append(Problem(CLAIM_KIND, label, bad.reason, bad.message, namespace,
                                         where))
            return
        if claim.key in self.claim_keys:
            self.problems.append(Problem(CLAIM_KIND, claim.name, DUPLICATE,
                                         f"claim {claim.key} is defined more than once",
                                         namespace, where))
            return
        other = self.model_names.get(claim.model_name)
        if other is not None:
            self.problems.append(Problem(
                CLAIM_KIND, claim.name, DUPLICATE,
                f"modelName {claim.model_name!r} is already claimed by {other}; give each claim "
                "its own model name", namespace, where))
            return
        self.claim_keys.add(claim.key)
        self.model_names[claim.model_name] = claim.key
        claim = _with_source(claim, where)
        self.claims.append(claim)
        self.problems.extend(claim.problems)

    def _pool(self, obj: Mapping[str, Any], label: str, namespace: str, where: str) -> None:
        try:
            pool = pool_from_object(obj)
        except ManifestError as bad:
            self.problems.append(Problem(POOL_KIND, label, bad.reason, bad.message, namespace,
                                         where))
            return
        self._add_pool(pool, where)

    def _deployment(self, obj: Mapping[str, Any], label: str, namespace: str,
                    where: str) -> None:
        agents = self.deployment_agents.get(f"{namespace}/{label}")
        if agents is None:
            agents = self.deployment_agents.get(label)
        try:
            pool = pool_from_deployment(obj, agents or ())
        except ManifestError as bad:
            self.problems.append(Problem("Deployment", label, bad.reason, bad.message,
                                         namespace, where))
            return
        if not agents:
            self.problems.append(Problem(
                "Deployment", label, NO_AGENTS,
                "no agent URLs were given for this warm pool, so no claim can be placed on it",
                namespace, where))
        self._add_pool(pool, where)

    def _add_pool(self, pool: WarmPool, where: str) -> None:
        kind = pool.source_kind
        if pool.key in self.pool_keys:
            self.problems.append(Problem(kind, pool.name, DUPLICATE,
                                         f"pool {pool.key} is defined more than once",
                                         pool.namespace, where))
            return
        for agent in pool.agents:
            owner = self.agent_names.get(agent.name)
            if owner is not None:
                self.problems.append(Problem(
                    kind, pool.name, DUPLICATE,
                    f"agent {agent.name!r} is already in pool {owner}", pool.namespace, where))
                return
        self.pool_keys.add(pool.key)
        self.agent_names.update({a.name: pool.key for a in pool.agents})
        self.pools.append(pool)
        if pool.policy_problem is not None:
            self.problems.append(Problem(kind, pool.name, INVALID_POOL_POLICY,
                                         f"policy turned off: {pool.policy_problem}",
                                         pool.namespace, where))


def _with_source(claim: ModelClaim, where: str) -> ModelClaim:
    problems = tuple(replace(p, source=where) for p in claim.problems)
    return replace(claim, problems=problems) if problems else claim


# ---- claims ---------------------------------------------------------------------------------


def _metadata(obj: Mapping[str, Any], max_name: int | None) -> ObjectMeta:
    try:
        meta = ObjectMeta.model_validate(obj.get("metadata"))
    except ValidationError as exc:
        raise ManifestError(INVALID_MANIFEST, describe(exc, "metadata")) from None
    name = meta.name
    if max_name is not None and len(name) > max_name:
        raise ManifestError(INVALID_NAME, f"the name is {len(name)} characters long; a claim's "
                            f"name can be at most {max_name}, because it is part of "
                            "annotation keys on the Pod")
    if not _DNS_LABEL.fullmatch(name):
        raise ManifestError(INVALID_NAME, f"{name!r} is not a valid name: use lower-case letters, "
                            "digits, '-' and '.', starting and ending with a letter or digit")
    return meta


def claim_from_object(obj: Mapping[str, Any]) -> ModelClaim:
    """A ModelClaim from its decoded manifest; raises ``ManifestError`` for structural problems
    (the CRD's schema, ``ClaimSpec``) and records InvalidPerGPU / InvalidEngineConfig (the
    contract's rules, which the schema cannot say) in ``problems``."""
    if obj.get("apiVersion") != API_VERSION:
        raise ManifestError(INVALID_MANIFEST, f"apiVersion must be {API_VERSION}, "
                            f"got {obj.get('apiVersion')!r}")
    meta = _metadata(obj, MAX_CLAIM_NAME)
    name, namespace = meta.name, meta.namespace
    raw = obj.get("spec")
    try:
        spec = ClaimSpec.model_validate(raw)
    except ValidationError as exc:
        fields = {err["loc"][:1] for err in exc.errors()}
        if fields == {("replicas",)}:
            raise ManifestError(INVALID_REPLICAS, f"spec.replicas must be a whole number from 1 "
                                f"to {MAX_REPLICAS} (engines of the claim), got "
                                f"{cast(Mapping[str, Any], raw)['replicas']!r}") from None
        if fields == {("maxReplicas",)}:
            raise ManifestError(INVALID_REPLICAS, f"spec.maxReplicas must be a whole number "
                                f"from 1 to {MAX_REPLICAS} (the most engines of the claim), got "
                                f"{cast(Mapping[str, Any], raw)['maxReplicas']!r}") from None
        if fields == {("modelName",)}:  # the contract's wording, as the agent says it
            raise ManifestError(INVALID_SPEC, model_name_problem(
                cast(Mapping[str, Any], raw)["modelName"]) or describe(exc, "spec")) from None
        raise ManifestError(INVALID_SPEC, describe(exc, "spec")) from None
    if spec.maxReplicas is not None and spec.maxReplicas < spec.replicas:
        raise ManifestError(INVALID_REPLICAS, f"spec.maxReplicas ({spec.maxReplicas}) must be "
                            f"at least spec.replicas ({spec.replicas}), the fewest engines the "
                            "claim runs")
    model_name = name if spec.modelName is None else spec.modelName
    problem = model_name_problem(model_name)
    if problem is not None:
        raise ManifestError(INVALID_SPEC, problem)
    per_gpu, per_gpu_problem = per_gpu_from(spec.perGPU)
    args = {flag: str(value) for flag, value in
            ((spec.engineConfig.args if spec.engineConfig else None) or {}).items()}
    problems: list[Problem] = []
    args_problem = engine_args_problem(spec.engine, args)
    if args_problem is not None:
        problems.append(Problem(CLAIM_KIND, name, INVALID_ENGINE_CONFIG, args_problem,
                                namespace))
    if per_gpu_problem is not None:
        problems.append(Problem(CLAIM_KIND, name, INVALID_PER_GPU, per_gpu_problem, namespace))
    lifecycle, lifecycle_problem = lifecycle_of(obj["metadata"].get("annotations"))
    return ModelClaim(name, namespace, model_name, selector_from(spec.podSelector),
                      spec.artifactURL, spec.engine, spec.replicas, per_gpu, args,
                      tuple(problems), lifecycle, lifecycle_problem, meta.labels,
                      min_replicas=spec.replicas, max_replicas=spec.maxReplicas or 0)


def model_name_problem(name: object) -> str | None:
    """The one name rule (``contract.names``), worded for a claim."""
    return contract_model_name_problem(name, "spec.modelName")


PER_GPU_MISSING = ("spec.perGPU is missing: declare maximumFootprint and kvFloor, the GPU "
                   "memory one instance needs")


def per_gpu_from(spec: PerGPUSpec | None) -> tuple[PerGPU | None, str | None]:
    """(PerGPU, None), or (None, why) for InvalidPerGPU: a missing perGPU or figure, or one
    that is not positive. Its shape is the schema's (``PerGPUSpec``); a figure the pattern
    takes and ``parse_quantity`` cannot (``1e1.5``) is refused as malformed too."""
    if spec is None:
        return None, PER_GPU_MISSING
    figures: dict[str, int] = {}
    for key in ("maximumFootprint", "kvFloor"):
        value = getattr(spec, key)
        try:
            if value is not None:
                figures[key] = parse_quantity(value)
        except QuantityError as exc:
            raise ManifestError(INVALID_SPEC, f"spec.perGPU.{key}: {exc}") from None
    for key in ("maximumFootprint", "kvFloor"):
        if key not in figures:
            return None, f"spec.perGPU.{key} is missing"
        if figures[key] <= 0:
            return None, f"spec.perGPU.{key} must be positive, got {getattr(spec, key)!r}"
    return PerGPU(figures["maximumFootprint"], figures["kvFloor"]), None


def engine_args_problem(engine: Engine, args: Mapping[str, str]) -> str | None:
    """The contract's rule (the agent applies the same one), worded for a claim. ``--sim-*``
    knobs pass: only an agent knows whether it simulates the engine."""
    return contract_args_problem(engine, args, simulated=True, field="spec.engineConfig.args")


# ---- pools ----------------------------------------------------------------------------------


def _policy(spec_policy: object, annotations: object) -> tuple[PoolPolicy, str | None]:
    annotated = annotations.get(POLICY_ANNOTATION) if isinstance(annotations, Mapping) else None
    if spec_policy is not None and annotated is not None:
        return POLICY_OFF, f"give the policy once: spec.policy or the {POLICY_ANNOTATION} " \
            "annotation, not both"
    return parse_pool_policy(spec_policy if spec_policy is not None else annotated)


def _labels(raw: object, what: str) -> dict[str, str]:
    try:
        return LABELS.validate_python(raw) or {}
    except ValidationError as exc:
        raise ManifestError(INVALID_SPEC, describe(exc, what)) from None


def pool_from_object(obj: Mapping[str, Any]) -> WarmPool:
    """A pool from our ``kind: WarmPool`` manifest; raises ``ManifestError`` when malformed."""
    meta = _metadata(obj, None)
    try:
        spec = PoolSpec.model_validate(obj.get("spec"))
    except ValidationError as exc:
        raise ManifestError(INVALID_SPEC, describe(exc, "spec")) from None
    agents = [AgentRef(a.name, a.url.rstrip("/"), {**meta.labels, **a.labels})
              for a in spec.agents or ()]
    names = [a.name for a in agents]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ManifestError(INVALID_SPEC, f"agent {dup!r} appears more than once in spec.agents")
    policy, problem = _policy(spec.policy, obj["metadata"].get("annotations"))
    return WarmPool(meta.name, meta.namespace, tuple(agents), policy, meta.labels, problem)


def pool_from_deployment(obj: Mapping[str, Any], agents: Sequence[AgentRef]) -> WarmPool:
    """A pool from the guide's warm-pool Deployment: its Pods' labels (the template's), its
    policy annotation and its GPUs per Pod; ``agents`` are its Pods' runtime agents."""
    meta = _metadata(obj, None)
    spec = obj.get("spec")
    template = spec.get("template") if isinstance(spec, Mapping) else None
    tmeta = template.get("metadata") if isinstance(template, Mapping) else None
    pod_labels = meta.labels
    if isinstance(tmeta, Mapping) and tmeta.get("labels") is not None:
        pod_labels = _labels(tmeta.get("labels"), "spec.template.metadata.labels")
    gpus = _gpus_per_pod(template)
    refs = tuple(AgentRef(a.name, a.url.rstrip("/"), {**pod_labels, **a.labels}) for a in agents)
    policy, problem = _policy(None, obj["metadata"].get("annotations"))
    return WarmPool(meta.name, meta.namespace, refs, policy, pod_labels, problem, gpus,
                    "Deployment")


def _gpus_per_pod(template: object) -> int | None:
    pod = template.get("spec") if isinstance(template, Mapping) else None
    containers = pod.get("containers") if isinstance(pod, Mapping) else None
    if not isinstance(containers, list):
        return None
    total, found = 0, False
    for container in containers:
        resources = container.get("resources") if isinstance(container, Mapping) else None
        if not isinstance(resources, Mapping):
            continue
        for section in ("limits", "requests"):
            figures = resources.get(section)
            if isinstance(figures, Mapping) and GPU_RESOURCE in figures:
                try:
                    total += parse_quantity(figures[GPU_RESOURCE])
                except QuantityError:
                    raise ManifestError(INVALID_SPEC, f"{GPU_RESOURCE} must be a whole number, got "
                                        f"{figures[GPU_RESOURCE]!r}") from None
                found = True
                break
    return total if found else None
