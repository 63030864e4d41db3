"""Delay schedules: engine restarts and readiness probes. Pure functions over plain data."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from contract.phases import DEFAULT_RESTART_DELAYS

__all__ = ["DEFAULT_RESTART_DELAYS", "probe_delays", "restart_delay"]


def restart_delay(restarts_done: int, delays: Sequence[float]) -> float | None:
    """Delay before the next restart, or None when the engine's restart budget is spent.

    ``restarts_done`` counts the restarts already made over the engine's whole life.
    """
    if restarts_done < 0:
        raise ValueError("restarts_done must not be negative")
    if restarts_done >= len(delays):
        return None
    return float(delays[restarts_done])


def probe_delays(first: float, factor: float, cap: float) -> Iterator[float]:
    """Readiness probe delays: ``first``, then growing by ``factor`` up to ``cap``, forever."""
    if first <= 0 or factor < 1 or cap < first:
        raise ValueError("need first > 0, factor >= 1 and cap >= first")
    delay = first
    while True:
        yield delay
        delay = min(cap, delay * factor)
