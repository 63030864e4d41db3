"""Replicas of a claim: N engines of one ModelClaim, each reconciled as a claim of its own.

The seed allows one engine per claim (``replicas`` must be 1); this project allows 1 to
``MAX_REPLICAS`` (issue 25). Replica 0 *is* the claim: its key, its status, its engine's
``claim_ref``, exactly as a one-replica claim has always been, so nothing changes for
``replicas: 1``. Replica ``i`` >= 1 is reconciled under the key ``(namespace, "name#i")``
(``#`` is no character of a Kubernetes name, so no real claim can have that key): the same
placement, start, KV, idle sleep, wake, move and drain code runs for it, its engine carries
that name in its ``claim_ref``, and it has its own status (phase, conditions, instance).

Rules, with the bug each prevents:

* **Replicas go to different agents.** Placing replica ``i`` excludes every agent that runs,
  or has reserved, an engine of the same model (an agent knows an engine by its model name:
  two replicas on one agent would be one engine answering to two claims). When only such
  agents have room, the replica waits ``Pending`` with ``ReplicaNeedsAnotherPod``, saying
  so, rather than stacking on the same Pod silently.
* **Things that were keyed by model are keyed by replica** (``route_name``): route holds, the
  door's requests in flight, wake requests for a replica, the route published before a
  sleep. For replica 0 the name is the model name, as before. *Bug avoided:* holding one
  replica off the route before its idle sleep held every replica, and a request in flight to
  one kept every replica awake.
* **The claim's status summarises** (``summary_phase``): Active while any replica serves; else
  the least advanced phase of the replicas that still make progress; ``readyReplicas`` counts
  the Active ones. Each replica is one entry of ``status.instances`` with its own ``index``,
  agent (Pod), port, KV limit and phase.
* **Scaling down drains.** A replica whose index is no longer below ``spec.replicas`` has no
  claim: it is drained like a deleted claim (off the route, requests finish, engine stopped),
  the highest index first, since the lower ones stay.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MAX_REPLICAS = 8
SEP = "#"
REPLICA_NEEDS_ANOTHER_POD = "ReplicaNeedsAnotherPod"

ClaimKey = tuple[str, str]

# Phases (the status module's names; kept here as text so this module imports nothing)
_ORDER = ("Active", "Activating", "Sleeping", "Pending", "Failed")


def replica_key(key: ClaimKey, index: int) -> ClaimKey:
    """The key replica ``index`` is reconciled under (replica 0: the claim's own)."""
    if index < 0:
        raise ValueError("a replica index is never negative")
    return key if index == 0 else (key[0], f"{key[1]}{SEP}{index}")


def split(name: str) -> tuple[str, int]:
    """(the claim's name, the replica index) of a replica's name (``c#2`` -> ``("c", 2)``);
    a claim's own name is replica 0."""
    base, sep, tail = name.rpartition(SEP)
    if not sep or not tail.isdigit() or not base or tail != str(int(tail)) or tail == "0":
        return name, 0
    return base, int(tail)


def base_key(key: ClaimKey) -> ClaimKey:
    return (key[0], split(key[1])[0])


def index_of(key: ClaimKey) -> int:
    return split(key[1])[1]


def is_replica(key: ClaimKey) -> bool:
    """True for replica 1 and above (replica 0 is the claim itself)."""
    return index_of(key) > 0


def route_name(model: str, key: ClaimKey) -> str:
    """What route holds, the door's in-flight counts and wake requests call a replica: its
    model name for replica 0, ``model#i`` for replica ``i``."""
    index = index_of(key)
    return model if index == 0 else f"{model}{SEP}{index}"


def model_of_route(name: str) -> str:
    """The model name in a replica's route name."""
    return split(name)[0]


def replica_keys(key: ClaimKey, replicas: int) -> list[ClaimKey]:
    """Keys of replicas 1..replicas-1 (the claim's own key is replica 0)."""
    return [replica_key(key, i) for i in range(1, max(1, replicas))]


def surplus(key: ClaimKey, replicas: int, known: Iterable[ClaimKey]) -> list[ClaimKey]:
    """Replica keys among ``known`` (statuses the store holds) at or past ``replicas``: the
    replicas to drain, highest index first."""
    base = base_key(key)
    extra = [k for k in known if base_key(k) == base and index_of(k) >= max(1, replicas)]
    return sorted(extra, key=index_of, reverse=True)


def summary_phase(phases: Sequence[str]) -> str:
    """The claim's phase from its replicas' (replica 0 first): Active while any serves;
    otherwise the first phase of Activating, Sleeping, Pending, Failed that a replica has."""
    if not phases:
        return "Pending"
    for phase in _ORDER:
        if phase in phases:
            return phase
    return phases[0]


def ready_count(phases: Iterable[str]) -> int:
    """Replicas that serve (``readyReplicas``, ``aibrix_modelclaim_ready_replicas``)."""
    return sum(1 for p in phases if p == "Active")
