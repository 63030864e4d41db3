"""Placement: which agent (warm-pool Pod) takes a claim, and on which GPUs. Pure.

A candidate can take a claim when it is in the claim's namespace, matches its podSelector, is
enabled (label ``claim.model.aibrix.ai/enabled: "true"``), is healthy (and its snapshot fresh),
runs no engine that answers to no claim, and has as many GPUs as the claim needs: a vLLM or
SGLang claim uses every GPU of its Pod, so the count must equal tensor x pipeline parallel size;
an Ollama claim needs one GPU. It takes the claim when each of those GPUs has room for
``maximumFootprint + kvFloor`` (``state.charge`` says what each engine already there counts for).

Among the candidates with room: first one that has served the artifact before (its weights are
on the node), then the fewest models awake, then the most room (the least room among the GPUs
it would use), then the name, so the answer is deterministic.

A claim with no figures (``ClaimNeed.unmeasured``: no perGPU, and its artifact could not be read
to estimate them) is placed where it can be measured safely: on GPUs that no other engine uses
or has reserved (not even a sleeping one), with at least ``MEASURE_MIN_ROOM`` free. The engine
sizes itself there alone (the agent gives it the card's exclusive start turn), no other engine's
KV cache can be squeezed by it, and the agent's measurement of it (peak HBM less KV in use) is
its own. Until that measurement gives the claim figures, it holds those GPUs whole
(``state.Gpu.room``). Among such candidates: served the artifact first, then the most room, then
the name.

Answers: ``Placed(agent, devices)``, or ``Unplaced(reason, message)`` with the guide's reasons:
``InvalidPerGPU`` (no usable perGPU), ``TooLargeForAnyCard`` (larger than every GPU in the pool:
waiting is useless), ``NoMatchingPods`` (nothing can take it now; the message names the
candidate that came closest and what it lacks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contract.quantity import gib
from contract.reasons import INVALID_PER_GPU, NO_MATCHING_PODS, TOO_LARGE
from reconciler.model.manifests import DRAINING_LABEL, ENABLED_LABEL, ModelClaim
from reconciler.model.selector import LabelSelector
from reconciler.planning.state import Candidate, has_served, is_staging

NO_CANDIDATE = "no available candidate warm pod"
MEASURE_MIN_ROOM = 1 << 30  # free bytes an unmeasured claim needs on each GPU to be tried there
RETRY_DELAYS = (10.0, 20.0, 40.0)
RETRY_EVERY = 60.0
DEFAULT_MAX_SNAPSHOT_AGE = 30.0


@dataclass(frozen=True)
class ClaimNeed:
    """What placement needs to know of a claim. ``footprint``/``kv_floor``: per GPU, None when
    the claim has no usable perGPU. ``all_gpus``: the engine uses every GPU of its Pod, so the
    Pod's GPU count must equal ``gpus``; otherwise it needs ``gpus`` of them. ``exclude``:
    agents not to use (the one a claim is moving away from); ``apart``: agents that run another
    replica of the claim, not to use either."""

    name: str
    selector: LabelSelector
    footprint: int | None
    kv_floor: int | None
    gpus: int = 1
    all_gpus: bool = True
    namespace: str = "default"
    artifact_url: str = ""
    exclude: frozenset[str] = frozenset()
    # agents that run (or will run) another replica of the claim (``reconciler.replicas``)
    apart: frozenset[str] = frozenset()
    # Not empty: the claim has no figures, and this says why they could not be estimated; it is
    # placed to be measured (on GPUs of its own), not by room.
    unmeasured: str = ""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError("a claim needs at least one GPU")

    @property
    def room(self) -> int | None:
        """Bytes needed on each GPU, or None when perGPU is unusable."""
        if self.footprint is None or self.kv_floor is None:
            return None
        if self.footprint <= 0 or self.kv_floor <= 0:
            return None
        return self.footprint + self.kv_floor

    @classmethod
    def from_claim(cls, claim: ModelClaim, exclude: frozenset[str] = frozenset(),
                   apart: frozenset[str] = frozenset()) -> ClaimNeed:
        per_gpu = claim.per_gpu
        return cls(name=claim.key, selector=claim.pod_selector,
                   footprint=per_gpu.maximum_footprint if per_gpu else None,
                   kv_floor=per_gpu.kv_floor if per_gpu else None,
                   gpus=claim.gpus_needed, all_gpus=claim.engine != "ollama",
                   namespace=claim.namespace, artifact_url=claim.artifact_url, exclude=exclude,
                   apart=apart, unmeasured=claim.unmeasured if claim.to_measure else "")


@dataclass(frozen=True)
class Placed:
    agent: str
    devices: tuple[int, ...]  # ascending GPU indices
    room_left: int  # the least room left on those GPUs once the claim is there


@dataclass(frozen=True)
class Unplaced:
    reason: str  # InvalidPerGPU | TooLargeForAnyCard | NoMatchingPods
    message: str
    closest: str | None = None  # the candidate that came closest, for NoMatchingPods


def retry_delay(attempt: int) -> float:
    """Seconds before placement is tried again after ``attempt`` failed tries (0-based): 10, 20
    and 40, then every minute. Tries also happen at once when room may have appeared."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    return RETRY_DELAYS[attempt] if attempt < len(RETRY_DELAYS) else RETRY_EVERY


def gpu_count_fits(need: ClaimNeed, candidate: Candidate) -> bool:
    count = len(candidate.gpus)
    return count == need.gpus if need.all_gpus else count >= need.gpus


def selected(need: ClaimNeed, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The claim's pool: candidates in its namespace that match its podSelector."""
    return [c for c in candidates
            if c.namespace == need.namespace and need.selector.matches(c.labels)]


def unavailable(need: ClaimNeed, candidate: Candidate, now: float,
                max_snapshot_age: float = DEFAULT_MAX_SNAPSHOT_AGE) -> tuple[int, str] | None:
    """Why ``candidate`` cannot take the claim whatever its room, ranked (lower is closer to
    taking it), or None when it can if it has room."""
    if candidate.name in need.exclude:
        return 5, f"{candidate.name}: the claim is moving away from it"
    if candidate.name in need.apart:
        return 5, f"{candidate.name}: runs another replica of the claim"
    count = len(candidate.gpus)
    if not gpu_count_fits(need, candidate):
        wanted = f"{need.gpus}" if need.all_gpus else f"at least {need.gpus}"
        return 4, (f"{candidate.name}: has {count} GPU{'s' if count != 1 else ''}, "
                   f"the claim needs {wanted}")
    if not candidate.enabled:
        return 3, f"{candidate.name}: not enabled (label {ENABLED_LABEL} is not \"true\")"
    if candidate.draining:
        return 3, f"{candidate.name}: draining (label {DRAINING_LABEL}): its claims move away"
    if candidate.foreign_engines:
        return 2, (f"{candidate.name}: engine {', '.join(sorted(candidate.foreign_engines))} "
                   "answers to no claim")
    if not candidate.healthy:
        return 1, f"{candidate.name}: not ready"
    if candidate.observed_at is not None and now - candidate.observed_at > max_snapshot_age:
        return 1, (f"{candidate.name}: its snapshot is {now - candidate.observed_at:.0f} s old")
    return None


def choose_devices(need: ClaimNeed, candidate: Candidate) -> tuple[tuple[int, ...], int, int]:
    """(devices, least room among them, index of that GPU): every GPU for an all-GPU claim;
    otherwise the ``need.gpus`` GPUs with the most room (ties to the lower index)."""
    rooms = {g.index: g.room(candidate.policy) for g in candidate.gpus}
    if need.all_gpus:
        devices = sorted(rooms)
    else:
        devices = sorted(sorted(rooms, key=lambda i: (-rooms[i], i))[:need.gpus])
    tightest = min(devices, key=lambda i: (rooms[i], i))
    return tuple(devices), rooms[tightest], tightest


def place(need: ClaimNeed, candidates: Sequence[Candidate], now: float, *,
          max_snapshot_age: float = DEFAULT_MAX_SNAPSHOT_AGE) -> Placed | Unplaced:
    """Where the claim goes now, or why it cannot go anywhere. Pure."""
    room = need.room
    if room is None and need.unmeasured:
        return place_to_measure(need, candidates, now, max_snapshot_age=max_snapshot_age)
    if room is None or need.footprint is None or need.kv_floor is None:
        return Unplaced(INVALID_PER_GPU, "perGPU is missing or has a figure that is not "
                        "positive: declare maximumFootprint and kvFloor")
    pool = selected(need, candidates)
    if not pool:
        return _no_pool(need)
    cards = [g.usable for c in pool for g in c.gpus]
    if cards and room > max(cards):
        return Unplaced(TOO_LARGE, f"needs {gib(room)} on a GPU (maximumFootprint "
                        f"{gib(need.footprint)} + kvFloor {gib(need.kv_floor)}), but the largest "
                        f"GPU in the pool has {gib(max(cards))} usable")
    fits: list[tuple[tuple[bool, int, int, str], Placed]] = []
    short: list[tuple[int, str, str]] = []  # (shortfall, name, message)
    blocked: list[tuple[int, str, str]] = []  # (rank, name, message)
    for candidate in pool:
        why = unavailable(need, candidate, now, max_snapshot_age)
        if why is not None:
            blocked.append((why[0], candidate.name, why[1]))
            continue
        devices, least, tightest = choose_devices(need, candidate)
        if least >= room:
            key = (not has_served(candidate, need.artifact_url), candidate.models_awake,
                   -least, candidate.name)
            fits.append((key, Placed(candidate.name, devices, least - room)))
            continue
        free = gib(max(0, least))
        if len(devices) == 1:
            text = f"{candidate.name}: needs {gib(room)} on GPU, {free} free"
        else:
            text = (f"{candidate.name}: needs {gib(room)} on each of {len(devices)} GPUs, "
                    f"{free} free on GPU {tightest}")
        short.append((room - least, candidate.name, text))
    if fits:
        return min(fits, key=lambda f: f[0])[1]
    if short:
        _, name, text = min(short)
        return Unplaced(NO_MATCHING_PODS, text, name)
    return _all_unavailable(blocked)


def place_to_measure(need: ClaimNeed, candidates: Sequence[Candidate], now: float, *,
                     max_snapshot_age: float = DEFAULT_MAX_SNAPSHOT_AGE) -> Placed | Unplaced:
    """Where a claim with no figures goes to be measured: GPUs no other engine uses or has
    reserved, with ``MEASURE_MIN_ROOM`` free on each; or why none can take it. Pure."""
    pool = selected(need, candidates)
    if not pool:
        return _no_pool(need)
    lead = (f"the claim has no perGPU and no estimate ({need.unmeasured}), so it is measured "
            "on GPUs no other engine uses")
    fits: list[tuple[tuple[bool, int, str], Placed]] = []
    short: list[tuple[int, int, str, str]] = []  # (engines in the way, shortfall, name, text)
    blocked: list[tuple[int, str, str]] = []
    for candidate in pool:
        why = unavailable(need, candidate, now, max_snapshot_age)
        if why is not None:
            blocked.append((why[0], candidate.name, why[1]))
            continue
        devices = _emptiest(need, candidate)
        gpus = [g for g in candidate.gpus if g.index in devices]
        users = sorted({e.name for g in gpus for e in g.engines})
        least = min(g.usable - g.other for g in gpus)
        if not users and least >= MEASURE_MIN_ROOM:
            key = (not has_served(candidate, need.artifact_url), -least, candidate.name)
            fits.append((key, Placed(candidate.name, devices, least)))
        elif users:
            short.append((len(users), 0, candidate.name,
                          f"{candidate.name}: {gpus_text(devices)} "
                          f"{'runs' if len(devices) == 1 else 'run'} {', '.join(users)}"))
        else:
            short.append((0, MEASURE_MIN_ROOM - least, candidate.name,
                          f"{candidate.name}: {gib(max(0, least))} free on "
                          f"{gpus_text(devices)}, under the {gib(MEASURE_MIN_ROOM)} a "
                          "measured start needs"))
    if fits:
        return min(fits, key=lambda f: f[0])[1]
    if short:
        _, _, name, text = min(short)
        return Unplaced(NO_MATCHING_PODS, f"{lead}: {text}", name)
    return _all_unavailable(blocked)


def _no_pool(need: ClaimNeed) -> Unplaced:
    return Unplaced(NO_MATCHING_PODS, f"{NO_CANDIDATE}: no agent in namespace "
                    f"{need.namespace} matches the podSelector {need.selector.describe()}")


def _all_unavailable(blocked: list[tuple[int, str, str]]) -> Unplaced:
    """Every candidate unavailable: the closest one (lowest rank), and how many others."""
    rank, name, text = min(blocked)
    others = len(blocked) - 1
    more = f"; {others} other candidate{'s' if others != 1 else ''} unavailable" if others else ""
    return Unplaced(NO_MATCHING_PODS, f"{NO_CANDIDATE}: {text}{more}", name)


def _emptiest(need: ClaimNeed, candidate: Candidate) -> tuple[int, ...]:
    """Every GPU for an all-GPU claim; otherwise the ``need.gpus`` GPUs with the fewest engines,
    then the most memory free of other processes, then the lower index."""
    if need.all_gpus:
        return tuple(sorted(g.index for g in candidate.gpus))
    order = sorted(candidate.gpus, key=lambda g: (len(g.engines), g.other - g.usable, g.index))
    return tuple(sorted(g.index for g in order[:need.gpus]))


def gpus_text(devices: Sequence[int]) -> str:
    return f"GPU{'s' if len(devices) != 1 else ''} {','.join(str(d) for d in devices)}"


def prestage_targets(need: ClaimNeed, candidates: Sequence[Candidate], now: float,
                     max_snapshot_age: float = DEFAULT_MAX_SNAPSHOT_AGE) -> list[str]:
    """Agents that should stage the claim's artifact before it is placed: in the claim's pool,
    whose policy asks for it (``artifacts.preStage``), able to take the claim once they have
    room, and neither holding the artifact ready nor staging it already."""
    return [c.name for c in selected(need, candidates)
            if c.policy.pre_stage and unavailable(need, c, now, max_snapshot_age) is None
            and not has_served(c, need.artifact_url) and not is_staging(c, need.artifact_url)]
