"""The planners' view of a warm pool: agents (``Candidate``), their GPUs, the engines on them.

All byte figures are per GPU, as a claim's ``perGPU`` declares them. What one engine counts for
on each of its GPUs (``charge``) is the guide's rule:

* awake or starting: its footprint plus its KV cache, and the KV cache counts as at least its KV
  floor (``kv_used`` when known and larger: kvcached never evicts live KV, so memory already in
  use is not room);
* asleep, by default: its whole room (footprint + KV floor), so it can wake where it is;
* asleep with ``noWakeReserveWhileAsleep``: what it still holds (``sleeping_footprint``, measured
  after each sleep), or its whole room while that is unknown;
* not measured yet (``unmeasured``: its claim has no figures, ``reconciler.model.estimated``):
  the whole of every GPU it is on, whatever it holds so far, until its measurement gives its
  claim figures. Nothing else is placed or grown there meanwhile (``Gpu.room`` is at most 0),
  and its own KV cache is given no limit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType

from reconciler.model.manifests import DRAINING_LABEL, ENABLED_LABEL
from reconciler.model.policy import POLICY_OFF, PoolPolicy


class EngineState(StrEnum):
    STARTING = "starting"  # activating, booting, restarting or waking: holds its whole room
    AWAKE = "awake"  # active: serves, has a KV cache, may be put to sleep
    ASLEEP = "asleep"


@dataclass(frozen=True)
class Resident:
    """One engine, as the planners see it on each of its GPUs.

    ``running``/``waiting``: requests now (None: not known, so never taken for idle).
    ``last_busy``: when it last had a request running or waiting, or became awake (None: not
    known, so never idle long enough). ``sleeping_footprint``: for a sleeping engine, what it
    holds now as measured after its sleep (None: unknown); for an awake one, what it held after
    its last sleep, if it ever slept (an estimate for victim choice). ``kv_limit``: the KV limit
    it runs with now (None: not known or not set yet). ``can_sleep``: only vLLM engines sleep.
    ``make_room_after``: its claim's own idle time before it may be slept for room (inf: never;
    None: the pool's). ``unmeasured``: its claim has no figures yet (``footprint`` is what it
    was seen to hold, ``kv_floor`` 0): it holds its GPUs whole, and is never slept.
    """

    name: str
    footprint: int
    kv_floor: int
    state: EngineState = EngineState.AWAKE
    running: float | None = 0.0
    waiting: float | None = 0.0
    last_busy: float | None = None
    kv_used: int | None = None
    kv_limit: int | None = None
    sleeping_footprint: int | None = None
    can_sleep: bool = True
    make_room_after: float | None = None  # its claim's own sleepToMakeRoomAfterSeconds
    unmeasured: bool = False

    @property
    def room(self) -> int:
        """What the engine needs awake on a GPU: its footprint plus its KV floor."""
        return self.footprint + self.kv_floor

    @property
    def load(self) -> float | None:
        """Requests running plus waiting, or None when either is unknown."""
        if self.running is None or self.waiting is None:
            return None
        return self.running + self.waiting

    @property
    def asleep(self) -> bool:
        return self.state is EngineState.ASLEEP

    def idle_for(self, now: float) -> float | None:
        """Seconds without a request running or waiting; None when busy or not known."""
        if self.load is None or self.load > 0 or self.last_busy is None:
            return None
        return max(0.0, now - self.last_busy)


def holds_only_sleeping_footprint(engine: Resident, policy: PoolPolicy) -> bool:
    """A sleeping engine that reserves only what it still holds (noWakeReserveWhileAsleep,
    measured): it has no KV reservation."""
    return (engine.asleep and policy.no_wake_reserve_while_asleep
            and engine.sleeping_footprint is not None)


def charge(engine: Resident, policy: PoolPolicy) -> int:
    """Bytes ``engine`` counts for on each of its GPUs when looking for room (an unmeasured
    engine: what it was seen to hold; ``Gpu.room`` gives it the rest of the GPU too)."""
    if engine.unmeasured:
        return engine.footprint
    if engine.asleep:
        if policy.no_wake_reserve_while_asleep and engine.sleeping_footprint is not None:
            return engine.sleeping_footprint
        return engine.room
    return engine.footprint + max(engine.kv_floor, engine.kv_used or 0)


@dataclass(frozen=True)
class Gpu:
    """One GPU: its usable memory (total less what the driver reserves), the engines on it, and
    memory held by processes that are no engine's (``other``)."""

    index: int
    usable: int
    engines: tuple[Resident, ...] = ()
    other: int = 0

    def room(self, policy: PoolPolicy, *, leave_out: str | None = None) -> int:
        """Free bytes for a newcomer; ``leave_out``: an engine whose charge does not count (a
        waking engine, which needs its room again). At most 0 while an unmeasured engine is
        on it. Remembered per GPU value (it is frozen): a placement over a fleet asks every GPU,
        and the same GPU values serve many."""
        memo: dict[tuple[PoolPolicy, str | None], int] = self.__dict__.setdefault("_rooms", {})
        got = memo.get((policy, leave_out))
        if got is None:
            counted = [e for e in self.engines if e.name != leave_out]
            got = self.usable - self.other - sum(charge(e, policy) for e in counted)
            if any(e.unmeasured for e in counted):
                got = min(got, 0)
            memo[(policy, leave_out)] = got
        return got


@dataclass(frozen=True)
class Candidate:
    """A runtime agent (one warm-pool Pod) that may take claims.

    ``healthy``: running, with an address, its agent answering. ``observed_at``: when its
    snapshot was taken (None: the caller vouches for it). ``foreign_engines``: engines that
    answer to no claim; the controller cannot tell what they hold, so it places nothing here.
    """

    name: str
    gpus: tuple[Gpu, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    namespace: str = "default"
    healthy: bool = True
    cached_artifacts: frozenset[str] = frozenset()
    policy: PoolPolicy = POLICY_OFF
    observed_at: float | None = None
    foreign_engines: tuple[str, ...] = ()
    staging_artifacts: frozenset[str] = frozenset()  # downloading into its weight cache now

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))

    @property
    def enabled(self) -> bool:
        """The Pod has ``claim.model.aibrix.ai/enabled: "true"``."""
        return self.labels.get(ENABLED_LABEL) == "true"

    @property
    def draining(self) -> bool:
        """The Pod has ``claim.model.aibrix.ai/draining: "true"`` (ours): nothing new is placed
        on it, and its claims move away, make before break (``reconciler.moving``)."""
        return self.labels.get(DRAINING_LABEL) == "true"

    @property
    def residents(self) -> dict[str, Resident]:
        """Every engine on the agent, once (an engine on two GPUs appears on both)."""
        out: dict[str, Resident] = {}
        for gpu in self.gpus:
            for engine in gpu.engines:
                out.setdefault(engine.name, engine)
        return out

    @property
    def models_awake(self) -> int:
        return sum(1 for e in self.residents.values() if not e.asleep)

    def with_resident(self, engine: Resident, devices: Sequence[int]) -> Candidate:
        """This agent with ``engine`` added to (or replaced on) the GPUs ``devices``: how a
        caller accounts for a placement before the next snapshot shows it."""
        gpus = tuple(
            replace(g, engines=tuple(e for e in g.engines if e.name != engine.name)
                    + ((engine,) if g.index in devices else ()))
            for g in self.gpus)
        return replace(self, gpus=gpus)


def same_artifact(a: str, b: str) -> bool:
    """``hf://x`` and ``huggingface://x`` name the same artifact; a trailing '/' is no change."""
    return artifact_id(a) == artifact_id(b)


def artifact_id(url: str) -> str:
    """The one spelling of an artifact URL (what ``same_artifact`` compares)."""
    url = url.rstrip("/")
    return "huggingface://" + url[len("hf://"):] if url.startswith("hf://") else url


def has_served(candidate: Candidate, artifact_url: str) -> bool:
    """The agent has the artifact ready in its weight cache (``cached_artifacts`` lists only
    entries that are complete and checked on disk)."""
    return any(same_artifact(artifact_url, a) for a in candidate.cached_artifacts)


def is_staging(candidate: Candidate, artifact_url: str) -> bool:
    return any(same_artifact(artifact_url, a) for a in candidate.staging_artifacts)
