"""The desired state: the claims, pools and routes of a manifest directory, as last read.

The reconciler runs against local manifests: a directory of ModelClaims (any ``*.yaml``) and a
pool file (``kind: WarmPool`` naming the agents, in the directory or elsewhere). The
``DirectorySource`` hands every created, changed or deleted file to ``on_file``, which re-parses
everything (per-object problems, never an exception) and answers the claim keys to reconcile:
the claims that appeared, changed or went away, and every claim when a pool changed.

Two rules Kubernetes would give us and a directory does not:

* A claim whose new text is structurally invalid (Kubernetes would refuse the update) keeps its
  last valid version, and the problem is reported; a typo never stops a model.
* The guide's warm-pool Deployment (kind Deployment) has no agent addresses here, so it cannot
  be a pool; its ``NoAgents`` problem is dropped. The WarmPool names the agents.

Embedded mode (``local_agent``): the local agent is the whole pool. Its labels are the
WarmPool's (when the directory has one, whose policy is used too), then the claims' matchLabels,
then the guide's sample labels, so the claims in the directory select it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from contract.reasons import INVALID_ENGINE_CONFIG, INVALID_PER_GPU
from reconciler.desired import ClaimKey, Lookups, claim_key, key_text
from reconciler.footprints import FootprintBook, Measured
from reconciler.model.changes import take_change
from reconciler.model.estimated import re_estimate, with_estimates
from reconciler.model.manifests import (
    CLAIM_KIND,
    DUPLICATE,
    ENABLED_LABEL,
    NO_AGENTS,
    POOL_LABEL,
    AgentRef,
    ModelClaim,
    ParseResult,
    Problem,
    RouteDocument,
    WarmPool,
    parse_manifests,
)
from reconciler.selection.route_manifests import routes_from

log = logging.getLogger("reconciler.local.desired")

MANIFEST_UNREADABLE = "ManifestUnreadable"
DIRECTORY_UNREADABLE = "ClaimsDirectoryUnreadable"
SAMPLE_LABELS = {POOL_LABEL: "pool-a", ENABLED_LABEL: "true"}
SUFFIXES = (".yaml", ".yml")


class DesiredState(Lookups):
    """Manifest texts by file, parsed together. ``on_file`` is the DirectorySource mapping."""

    def __init__(self, claims_dir: Path, pool_file: Path | None = None, *,
                 local_agent: AgentRef | None = None, footprints: Path | None = None) -> None:
        super().__init__()
        self.claims_dir = claims_dir
        self.pool_file = pool_file
        self.local_agent = local_agent
        self._texts: dict[Path, str] = {}
        self._cache: dict[Path, tuple[str, ParseResult, int]] = {}
        self.footprints = FootprintBook(footprints)
        self.problems: tuple[Problem, ...] = ()
        self._good: dict[Path, ParseResult] = {}  # each file's last parse that read cleanly
        self._unreadable: dict[Path, tuple[str, str]] = {}  # files whose text is not taken
        self._dir_problem: str | None = None
        self._logged: set[Problem] = set()  # each problem is logged once, when first found

    # ---- reading ----------------------------------------------------------------------------

    def load(self) -> None:
        """Blocking: read every manifest now (at start; the sources take over afterwards)."""
        paths = sorted(p for p in self.claims_dir.glob("*")
                       if p.suffix in SUFFIXES and not p.name.startswith(".") and p.is_file())
        if self.pool_file is not None and self.pool_file.is_file():
            paths.append(self.pool_file)
        for path in paths:
            self._texts[path.resolve()] = path.read_text("utf-8", errors="replace")
        self._reparse()

    def on_file(self, path: Path, old: str | None, new: str | None) -> Iterable[ClaimKey]:
        """A manifest was created, changed or deleted: the claim keys to reconcile."""
        path = path.resolve()
        if new is None:
            self._texts.pop(path, None)
        else:
            self._texts[path] = new
        before_claims, before_pools = dict(self.claims), self.pools
        before_problems = dict(self._spec_problems)
        self._reparse()
        keys = {k for k in before_claims.keys() | self.claims.keys()
                if before_claims.get(k) != self.claims.get(k)}
        keys |= {k for k in before_problems.keys() | self._spec_problems.keys()
                 if before_problems.get(k) != self._spec_problems.get(k)}
        if self.pools != before_pools:
            keys |= before_claims.keys() | self.claims.keys()
            for listener in self._pool_listeners:
                listener()
        return sorted(keys)

    def on_directory(self, path: Path, why: str | None) -> Iterable[ClaimKey]:
        """The claims directory cannot be read (``why``), or can again (None): a vanished
        directory is a failed read, never an empty one, so every claim keeps running and says
        why its manifest is not being read."""
        if why is not None:
            log.warning("claims directory %s cannot be read (%s); every claim keeps its last "
                        "good version", path, why)
        self._dir_problem = why
        self._reparse()
        return sorted(self.claims)

    def on_pool_file(self, path: Path, old: str | None, new: str | None) -> Iterable[ClaimKey]:
        """The DirectorySource mapping for a pool file outside the claims directory."""
        if self.pool_file is None or path.resolve() != self.pool_file.resolve():
            return []
        return self.on_file(path, old, new)

    # ---- lookups ----------------------------------------------------------------------------

    # ---- parsing ----------------------------------------------------------------------------

    def _parsed(self, path: Path, text: str) -> ParseResult:
        """One file's objects, parsed once per text (YAML parsing costs about a millisecond
        per claim; a hundred files re-parsed on every change would cost 100 ms)."""
        cached = self._cache.get(path)
        if cached is None or cached[0] != text or cached[2] != self.footprints.version:
            # A claim without perGPU is placed on its artifact's estimate (read once per text),
            # or on what an engine of it was measured at.
            parsed = with_estimates(parse_manifests(text, str(path)), self.footprints.lookup)
            cached = self._cache[path] = (text, parsed, self.footprints.version)
        return cached[1]

    def measured(self, artifact: str, args: Mapping[str, str], measured: Measured) -> bool:
        """An engine of a claim placed on an estimate was measured: True when that changed the
        claims' figures (every claim of the artifact and arguments is parsed again)."""
        if not self.footprints.observe(artifact, args, measured):
            return False
        self._reparse()
        return True

    def _file_result(self, path: Path, text: str) -> ParseResult:
        """The file's parse, or its last clean parse while its text cannot be read as a whole
        (broken YAML, or empty: caught between a truncate and a write)."""
        result = self._parsed(path, text)
        why = unreadable_reason(text, result)
        good = self._good.get(path)
        if why is None:
            self._good[path] = result
            self._unreadable.pop(path, None)
            return result
        if good is None or not (good.claims or good.pools):
            return result  # never read cleanly: nothing to keep
        if self._unreadable.get(path) != why:
            log.warning("manifest %s: %s: %s; its objects keep their last good version", path,
                        *why)
        self._unreadable[path] = why
        return good

    def _reparse(self) -> None:
        for gone in self._cache.keys() - self._texts.keys():
            del self._cache[gone]
        for gone in self._good.keys() - self._texts.keys():
            del self._good[gone]
            self._unreadable.pop(gone, None)
        results = {p: self._file_result(p, t) for p, t in sorted(self._texts.items())}
        result = merge(results.values())
        declared = {claim_key(c): c for c in result.claims}
        problems = self._keep_last_valid(result, declared)
        claims: dict[ClaimKey, ModelClaim] = {}
        for key, claim in declared.items():
            taken = take_change(self.claims.get(key), claim)
            claims[key] = self.scaled(key, taken.claim)
            if taken.problem is not None:  # the running version kept: its own figures
                claims[key] = self.scaled(key, re_estimate(taken.claim, self.footprints.lookup))
            if taken.problem is not None:
                problems[key] = taken.problem
        for path, (reason, message) in self._unreadable.items():
            for claim in results[path].claims:
                problems[claim_key(claim)] = Problem(
                    CLAIM_KIND, claim.name, reason, f"{message}; the claim keeps its last good "
                    "version", claim.namespace, str(path))
        if self._dir_problem is not None:
            problems = {k: Problem(CLAIM_KIND, k[1], DIRECTORY_UNREADABLE,
                                   f"the claims directory cannot be read ({self._dir_problem}); "
                                   "the claim keeps its last good version", k[0])
                        for k in claims}
        for key, problem in problems.items():
            if self._spec_problems.get(key) != problem:
                log.warning("claim %s: %s: %s", key_text(key), problem.reason, problem.message)
        self._spec_problems = problems
        if claims != self.claims:
            self.claims_version += 1
        self.claims = claims
        self._by_model = {c.model_name: k for k, c in claims.items()}
        self.routes, route_problems = routes_from(result.routes, self._by_model)
        self.pools = self._effective_pools(result)
        self._agents = {a.name: (a, p) for p in self.pools for a in p.agents}
        self.problems = tuple(p for p in result.problems if p.reason != NO_AGENTS) \
            + route_problems + tuple(problems.values())
        found = {p for p in result.problems if p.reason != NO_AGENTS} | set(route_problems)
        for problem in sorted(found - self._logged, key=str):  # a manifest that is not taken
            log.warning("invalid manifest: %s", problem)
        self._logged = found

    def _keep_last_valid(self, result: ParseResult,
                         claims: dict[ClaimKey, ModelClaim]) -> dict[ClaimKey, Problem]:
        """Put back into ``claims`` the running version of each claim whose new text is not a
        valid claim (a misspelt field, an unknown engine); its problem, naming the field, is the
        claim's spec problem, so ``SpecApplied`` says the edit was not taken."""
        kept: dict[ClaimKey, Problem] = {}
        for problem in result.problems:
            key = (problem.namespace or "default", problem.name)
            if problem.kind != CLAIM_KIND or key in claims or key not in self.claims:
                continue
            if problem.reason in (INVALID_PER_GPU, INVALID_ENGINE_CONFIG):
                continue
            claims[key] = self.claims[key]
            kept[key] = Problem(CLAIM_KIND, problem.name, problem.reason,
                                f"{problem.message}; the change was not taken, the claim keeps "
                                "its last valid version", problem.namespace, problem.source)
        return kept

    def _effective_pools(self, result: ParseResult) -> tuple[WarmPool, ...]:
        pools = tuple(p for p in result.pools if p.agents or p.source_kind != "Deployment")
        if self.local_agent is None:
            return pools
        labels: dict[str, str] = dict(SAMPLE_LABELS)
        from_claims: set[str] = set()
        for claim in sorted(self.claims.values(), key=lambda c: c.key):
            for k, v in claim.pod_selector.match_labels.items():
                if k not in from_claims:  # the first claim to name a label sets it
                    labels[k] = v
                    from_claims.add(k)
        base = pools[0] if pools else None
        if base is not None:
            labels.update(base.labels)
        agent = AgentRef(self.local_agent.name, self.local_agent.url,
                         {**labels, **self.local_agent.labels})
        if base is None:
            return (WarmPool("local", "default", (agent,), labels=labels),)
        return (WarmPool(base.name, base.namespace, (agent,), base.policy, labels,
                         base.policy_problem, base.gpus_per_agent),)


def unreadable_reason(text: str, result: ParseResult) -> tuple[str, str] | None:
    """Why a file's text cannot be taken as what it declares (None: it can): it is empty, or a
    document in it is not YAML or not a manifest."""
    if not text.strip():
        return MANIFEST_UNREADABLE, "the file is empty (read while it was being written?)"
    bad = next((p for p in result.problems if p.kind == "Document"), None)
    if bad is not None:
        return bad.reason, f"{bad.source}: {bad.message}"
    return None


def merge(results: Iterable[ParseResult]) -> ParseResult:
    """Files parsed one by one, put together with the checks across files that
    ``parse_sources`` makes: a claim key, a modelName, a pool key and an agent name once each
    (the first file, by path, wins; the others are ``Duplicate`` problems)."""
    claims: list[ModelClaim] = []
    pools: list[WarmPool] = []
    problems: list[Problem] = []
    ignored: list[str] = []
    routes: list[RouteDocument] = []
    keys: set[str] = set()
    models: dict[str, str] = {}
    pool_keys: set[str] = set()
    agents: dict[str, str] = {}
    for result in results:
        problems.extend(result.problems)
        ignored.extend(result.ignored)
        routes.extend(result.routes)
        for claim in result.claims:
            other = models.get(claim.model_name)
            if claim.key in keys or other is not None:
                why = f"claim {claim.key} is defined more than once" if claim.key in keys else \
                    f"modelName {claim.model_name!r} is already claimed by {other}"
                problems.append(Problem(CLAIM_KIND, claim.name, DUPLICATE, why, claim.namespace))
                continue
            keys.add(claim.key)
            models[claim.model_name] = claim.key
            claims.append(claim)
        for pool in result.pools:
            clash = next((agents[a.name] for a in pool.agents if a.name in agents), None)
            if pool.key in pool_keys or clash is not None:
                why = f"pool {pool.key} is defined more than once" if clash is None else \
                    f"an agent of this pool is already in pool {clash}"
                problems.append(Problem(pool.source_kind, pool.name, DUPLICATE, why,
                                        pool.namespace))
                continue
            pool_keys.add(pool.key)
            agents.update({a.name: pool.key for a in pool.agents})
            pools.append(pool)
    return ParseResult(tuple(claims), tuple(pools), tuple(problems), tuple(ignored),
                       tuple(routes))
