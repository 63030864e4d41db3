"""The desired state as both run modes hand it to the reconcilers: claims, pools and routes.

``Desired`` is what the reconcilers read, whichever mode keeps it: a manifest directory
(``reconciler.local.desired.DesiredState``) or the Kubernetes API
(``reconciler.kube.desired.KubeDesired``). Both build on ``Lookups``, the indexes they answer
from (claims by key and by model, agents by name with their pool), so placement, policy and the
door run one implementation against either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol

from reconciler.footprints import Measured
from reconciler.model.manifests import AgentRef, ModelClaim, Problem, WarmPool
from reconciler.replicas import base_key, index_of
from reconciler.selection.route_spec import Route

ClaimKey = tuple[str, str]  # (namespace, name)


class Desired(Protocol):
    """What the reconcilers read of the desired state, in either mode: a manifest directory
    (``reconciler.local.desired.DesiredState``) or the Kubernetes API
    (``reconciler.kube.desired.KubeDesired``). Both hand out the same ``ModelClaim`` and
    ``WarmPool`` values, so placement and policy run one implementation."""

    @property
    def claims(self) -> Mapping[ClaimKey, ModelClaim]: ...

    @property
    def pools(self) -> tuple[WarmPool, ...]: ...

    @property
    def problems(self) -> tuple[Problem, ...]: ...

    @property
    def routes(self) -> Mapping[str, Route]:
        """The ModelRoutes by name (what clients send as ``model``), as
        ``reconciler.selection.route_manifests.routes_from`` took them, in either mode."""
        ...

    @property
    def claims_version(self) -> int:
        """A number that changes whenever a claim is added, changed or removed (the door's route
        candidates are ranked once per version: the Kubernetes mode changes ``claims`` in
        place, so the mapping's identity says nothing)."""
        ...

    def claim(self, key: ClaimKey) -> ModelClaim | None: ...

    def scale(self, key: ClaimKey, count: int) -> bool:
        """Run ``count`` engines of a claim with copies by demand (``planning.scaling``),
        within its range, until the scaler says otherwise (a new version of the claim keeps
        it, brought into its range); True when that changed the claim."""
        ...

    def by_model(self, model_name: str) -> ClaimKey | None: ...

    def agents(self) -> list[tuple[AgentRef, WarmPool]]: ...

    def agent(self, name: str) -> tuple[AgentRef, WarmPool] | None: ...

    def pool_of(self, agent_name: str) -> WarmPool | None: ...

    def on_pools_changed(self, listener: Callable[[], None]) -> None: ...

    def spec_problem(self, key: ClaimKey) -> Problem | None:
        """Why the declared spec is not the one that runs (None: it runs as declared)."""
        ...

    def measured(self, artifact: str, args: Mapping[str, str], measured: Measured) -> bool:
        """An engine of a claim placed on an estimate was measured (True: figures changed)."""
        ...


def claim_key(claim: ModelClaim) -> ClaimKey:
    return (claim.namespace, claim.name)


def key_text(key: ClaimKey) -> str:
    return f"{key[0]}/{key[1]}"


class Lookups:
    """The lookups both desired states answer from the same indexes (claims by key and by model,
    agents by name with their pool, the problems of declared specs)."""

    def __init__(self) -> None:
        self.claims: dict[ClaimKey, ModelClaim] = {}
        self.pools: tuple[WarmPool, ...] = ()
        self.routes: dict[str, Route] = {}
        self.claims_version = 0
        self._by_model: dict[str, ClaimKey] = {}
        self._agents: dict[str, tuple[AgentRef, WarmPool]] = {}
        self._spec_problems: dict[ClaimKey, Problem] = {}
        self._pool_listeners: list[Callable[[], None]] = []
        self._replicas: dict[ClaimKey, tuple[ModelClaim, ModelClaim]] = {}
        self._scaled: dict[ClaimKey, int] = {}  # copies by demand: the count chosen per claim

    def claim(self, key: ClaimKey) -> ModelClaim | None:
        """The claim, or for a replica key (``reconciler.replicas``) the claim as its replica
        ``i`` is reconciled: named ``name#i``; None once ``replicas`` is ``i`` or less."""
        found = self.claims.get(key)
        index = index_of(key)
        if found is not None or index == 0:
            return found
        base = self.claims.get(base_key(key))
        if base is None or base.replicas <= index:
            self._replicas.pop(key, None)
            return None
        known = self._replicas.get(key)
        if known is None or known[0] is not base:
            known = self._replicas[key] = (base, replace(base, name=key[1]))
        return known[1]

    def by_model(self, model_name: str) -> ClaimKey | None:
        return self._by_model.get(model_name)

    def scale(self, key: ClaimKey, count: int) -> bool:
        claim = self.claims.get(key)
        if claim is None or claim.replica_range is None:
            return False
        self._scaled[key] = count
        scaled = self.scaled(key, claim)
        if scaled == claim:
            return False
        self.claims[key] = scaled
        self.claims_version += 1
        return True

    def scaled(self, key: ClaimKey, claim: ModelClaim) -> ModelClaim:
        """``claim`` (a version just read) with the count copies by demand chose for it, in
        its range; both run modes store every version they take through this."""
        span = claim.replica_range
        if span is None:
            self._scaled.pop(key, None)
            return claim
        count = min(max(self._scaled.get(key, span[0]), span[0]), span[1])
        return claim if claim.replicas == count else replace(claim, replicas=count)

    def spec_problem(self, key: ClaimKey) -> Problem | None:
        return self._spec_problems.get(base_key(key))

    def measured(self, artifact: str, args: Mapping[str, str], measured: Measured) -> bool:
        """Both run modes keep a footprint book and override this (``reconciler.local.desired``,
        ``reconciler.kube.desired``); a desired state without one has nothing to do."""
        return False

    def agents(self) -> list[tuple[AgentRef, WarmPool]]:
        """Every agent of every pool, with its pool."""
        return list(self._agents.values())

    def agent(self, name: str) -> tuple[AgentRef, WarmPool] | None:
        return self._agents.get(name)

    def pool_of(self, agent_name: str) -> WarmPool | None:
        found = self._agents.get(agent_name)
        return found[1] if found is not None else None

    def on_pools_changed(self, listener: Callable[[], None]) -> None:
        self._pool_listeners.append(listener)
