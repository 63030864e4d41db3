"""The seed's queue-or-unload arithmetic, in seconds of expected delay ("Queue or unload").

* ``queue_wait``: when a new call could start on a warm copy: the soonest in-flight call's
  remaining time (its start time plus the engine's recent latency, an exponentially weighted
  average, ``DEFAULT_LATENCY_S`` = 30 s when none was seen), plus one latency per call there
  beyond the engine's slots, spread across the slots. With one slot, one call 5 s into a 20 s
  call frees in 15 s; five calls there (one running, four waiting) make 15 + 4·20 = 95 s.
* ``bring_up``: the requested model's load (or wake) time: measured for that engine where
  known, else its size at ``LOAD_BYTES_PER_S`` (1 GiB/s, the seed's).
* ``victim_cost``: per victim, its unload time (measured, else ``UNLOAD_S`` = 1 s) plus its
  reload time (measured, else its size at 1 GiB/s) times its expected near-future demand,
  waiters + intents + 0.5·(recent use + prediction) (``Demand.expected``).
* the unload option is ``bring_up`` plus the victims' costs; the queue wins when its wait is no
  longer than that (``queue_wins``).
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.quantity import GiB

DEFAULT_LATENCY_S = 30.0
LOAD_BYTES_PER_S = float(GiB)
UNLOAD_S = 1.0


@dataclass(frozen=True)
class Demand:
    """A model's demand now: requests waiting for it, plans that intend to use it, its recent
    use (a rate) and a forecast; ``last_used`` (a clock value; None: never)."""

    waiters: int = 0
    intents: int = 0
    recent_use: float = 0.0
    prediction: float = 0.0
    last_used: float | None = None

    @property
    def expected(self) -> float:
        """The seed's expected near-future requests."""
        return self.waiters + self.intents + 0.5 * (self.recent_use + self.prediction)


def latency_of(ewma_s: float | None) -> float:
    return DEFAULT_LATENCY_S if ewma_s is None or ewma_s <= 0 else ewma_s


def queue_terms(in_flight: tuple[float, ...], queued: int, slots: int,
                latency_s: float | None) -> tuple[float, float]:
    """``queue_wait`` as (the clock value when the soonest call should end, or -inf when a slot
    is free; the backlog in seconds behind it)."""
    slots = max(1, slots)
    latency = latency_of(latency_s)
    soonest_end = min(in_flight) + latency if len(in_flight) >= slots else float("-inf")
    return soonest_end, max(0, len(in_flight) + queued - slots) * latency / slots


def queue_wait(in_flight: tuple[float, ...], queued: int, slots: int, latency_s: float | None,
               now: float) -> float:
    """Seconds until a new call could start on a copy with requests started at ``in_flight``
    (clock values), ``queued`` more waiting, and ``slots`` parallel slots: the soonest call's
    remaining time (never below 0: a call past its average may end any moment) plus the
    backlog."""
    soonest_end, backlog = queue_terms(in_flight, queued, slots, latency_s)
    return max(0.0, soonest_end - now) + backlog


def transfer_time(measured_s: float | None, size: int) -> float:
    """A measured time where known, else ``size`` bytes at the seed's 1 GiB/s."""
    return measured_s if measured_s is not None and measured_s >= 0 else size / LOAD_BYTES_PER_S


def bring_up(measured_s: float | None, size: int) -> float:
    """The requested model's load or wake time."""
    return transfer_time(measured_s, size)


def victim_cost(size: int, demand: Demand, unload_s: float | None = None,
                reload_s: float | None = None) -> float:
    """What releasing a victim costs: its unload time plus its reload time times its demand."""
    unload = unload_s if unload_s is not None and unload_s >= 0 else UNLOAD_S
    return unload + transfer_time(reload_s, size) * demand.expected


def queue_wins(queue_s: float | None, unload_s: float | None) -> bool:
    """The queue wins when it exists and its wait is no longer than unloading (or unloading
    is impossible)."""
    return queue_s is not None and (unload_s is None or queue_s <= unload_s)
