"""What the door's own forwards say of each claim's engine: the figures the route's queue option
needs (the seed's "Queue or unload", ``reconciler.selection.delay``).

Per claim (one engine per claim in the door's view): the start times (the door's clock) of the
requests the door has sent it and not had answered yet, and an exponentially weighted average
of how long its answers took (``ALPHA`` per new answer; None until one is seen, which the
formula reads as the seed's 30 s). Every forward counts, exact names included: a request sent
by its model's name takes an engine slot as much as one sent through a route. Only answers
that ended as the engine meant them (no upstream error, no client gone) feed the average.
Its recent use (``recent_use``: what a victim choice weighs, the seed's "recent use") is the
count of forwards started to it, each weighing less by half every ``USE_HALF_LIFE_S`` seconds.

``slots`` is what the engine runs at once, from the claim's engine args where they say it (vLLM
``--max-num-seqs``, Ollama ``--num-parallel``), else the engine's own default (``DEFAULT_SLOTS``:
vLLM 256, its ``max_num_seqs`` default; Ollama 1, its ``OLLAMA_NUM_PARALLEL`` default).

Changed only on the event loop, with no await between a forward's start and its count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from contract.numbers import whole_number
from reconciler.desired import ClaimKey

ALPHA = 0.3  # weight of the newest answer in the average
USE_HALF_LIFE_S = 300.0  # a forward's weight in the recent use halves every five minutes
DEFAULT_SLOTS = {"vllm": 256, "ollama": 1}
SLOTS_ARG = {"vllm": "--max-num-seqs", "ollama": "--num-parallel"}


def slots(engine: str, args: Mapping[str, str]) -> int:
    """Requests the claim's engine runs at once (see the module's docstring)."""
    n = whole_number(args.get(SLOTS_ARG.get(engine, ""), ""), strip=True)
    return n if n else DEFAULT_SLOTS.get(engine, 1)


class Forwards:
    """Requests in flight from the door and the latency average, per claim."""

    def __init__(self) -> None:
        self._started: dict[ClaimKey, list[float]] = {}
        self._latency: dict[ClaimKey, float] = {}
        self._use: dict[ClaimKey, tuple[float, float]] = {}  # (weight, when it was worked out)

    def start(self, key: ClaimKey, now: float) -> None:
        self._started.setdefault(key, []).append(now)
        self._use[key] = (self.recent_use(key, now) + 1.0, now)

    def end(self, key: ClaimKey, started: float, now: float, answered: bool) -> None:
        """The forward that began at ``started`` ended; ``answered``: it feeds the average."""
        times = self._started.get(key)
        if times is not None:
            times.remove(started)
            if not times:
                del self._started[key]
        if answered:
            took = max(0.0, now - started)
            old = self._latency.get(key)
            self._latency[key] = took if old is None else old + ALPHA * (took - old)

    def in_flight(self, key: ClaimKey) -> tuple[float, ...]:
        return tuple(self._started.get(key, ()))

    def latency(self, key: ClaimKey) -> float | None:
        return self._latency.get(key)

    def recent_use(self, key: ClaimKey, now: float) -> float:
        """Forwards started to the claim, each halved for every ``USE_HALF_LIFE_S`` since."""
        known = self._use.get(key)
        if known is None:
            return 0.0
        weight, at = known
        return weight * math.pow(0.5, max(0.0, now - at) / USE_HALF_LIFE_S)
