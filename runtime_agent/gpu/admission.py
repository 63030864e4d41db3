"""Admission: may this start, wake or sleep happen now, where, and if not, why. Pure functions.

Three answers, because the caller must act differently on each:

* ``TooLargeForAnyCard``: it can never fit on this Pod (more per card than any card offers once
  the reserve is set aside, or more cards than the Pod has). Refuse at once; waiting is useless.
* ``InsufficientGPUMemory``: it fits in principle but not now. The refusal names the bytes needed
  and free and the engines holding the memory, largest first, so a controller can choose whom to
  put to sleep; the caller may wait for a memory change.
* ``InsufficientHostMemory``: a level-1 sleep whose weights would not fit in host memory (a
  level-2 sleep discards its weights and always fits).

Device choice (worst fit): one card -> the card with the most room left after the request; N cards
-> the N cards with the most room; ties go to the card with the fewest engines on it, then to the
lower index (so engines that declare nothing, and are charged nothing until measured, spread over
the cards instead of all landing on card 0 and starting one at a time behind its start gate). Spreading, not packing, because in
a warm pool the room left on a card is what its sleeping engines need to wake (they wake where
they sleep) and what KV limits grow into; it also lets starts on different cards proceed in
parallel under the start gate. Keeping whole cards empty for large models is the controller's
placement job across Pods, and ``TooLargeForAnyCard`` tells it when a Pod cannot take a model.
"""

from __future__ import annotations

from collections.abc import Collection

from msgspec import Struct

from contract.quantity import gib
from contract.reasons import INSUFFICIENT_GPU, INSUFFICIENT_HOST, TOO_LARGE
from runtime_agent.gpu.host_ledger import HostLedger, HostRefusal, host_reserve
from runtime_agent.gpu.ledger import GpuLedger, LedgerRefusal, reserve


class Admit(Struct, frozen=True):
    devices: tuple[int, ...]  # ascending, as CUDA_VISIBLE_DEVICES lists them


class Refuse(Struct, frozen=True):
    reason: str  # TooLargeForAnyCard | InsufficientGPUMemory | InsufficientHostMemory
    message: str
    needed: int  # bytes per device (GPU) or bytes (host)
    free: int  # the best room on offer: per device for the N best cards (GPU), or host free
    holders: tuple[tuple[str, int], ...] = ()  # engines holding the memory, largest first


def _holders_text(holders: list[tuple[str, int]], other: int) -> str:
    parts = [f"{k} {gib(b)}" for k, b in holders]
    if other > 0:
        parts.append(f"other processes {gib(other)}")
    return "held by " + ", ".join(parts) if parts else "no engine holds memory there"


def admit(need_bytes: int, n_devices: int, ledger: GpuLedger, *, key: str | None = None,
          allowed: Collection[int] | None = None) -> Admit | Refuse:
    """Choose ``n_devices`` cards with ``need_bytes`` (footprint + KV floor) of room each.

    ``key``: an engine already in the ledger (a wake): only its own cards are candidates and its
    current charge there counts as its own. ``allowed``: restrict to these card indices."""
    if need_bytes < 0 or n_devices < 1:
        raise ValueError("need_bytes must be >= 0 and n_devices >= 1")
    holding = ledger.holdings.get(key) if key is not None else None
    candidates = sorted(holding.devices if holding else ledger.devices)
    if allowed is not None:
        candidates = [d for d in candidates if d in allowed]
    if holding is not None:
        n_devices = len(holding.devices)
    per_card = f"{gib(need_bytes)} on each of {n_devices} GPU{'s' if n_devices > 1 else ''}"
    if len(candidates) < n_devices:
        return Refuse(TOO_LARGE, f"needs {per_card}, but only {len(candidates)} GPU(s) are "
                      f"available to it on this Pod", need_bytes, 0)
    usable = sorted((ledger.devices[d].usable_bytes for d in candidates), reverse=True)
    if usable[n_devices - 1] < need_bytes:
        budget = ledger.devices[max(candidates, key=lambda d: ledger.devices[d].usable_bytes)]
        largest = (f"{gib(budget.usable_bytes)} ({gib(budget.total_bytes)} total less "
                   f"{gib(budget.reserve_bytes)} reserve)")
        if n_devices == 1:
            why = f"the largest card here offers {largest}"
        else:
            fit = sum(1 for u in usable if u >= need_bytes)
            why = (f"only {fit} of the {len(candidates)} GPUs offer that much (largest: "
                   f"{largest})")
        return Refuse(TOO_LARGE, f"needs {per_card}, but {why}", need_bytes,
                      usable[n_devices - 1])

    def room(device: int) -> int:
        own = ledger.charge(key, device) if key is not None else 0
        return ledger.room(device) + own

    def engines_on(device: int) -> int:
        return sum(1 for k, h in ledger.holdings.items() if k != key and device in h.devices)

    ranked = sorted(candidates, key=lambda d: (-room(d), engines_on(d), d))
    best = ranked[:n_devices]
    if room(best[-1]) >= need_bytes:
        return Admit(tuple(sorted(best)))
    free = max(0, room(best[-1]))
    holders = [(k, b) for k, b in ledger.holders(best) if k != key]
    other = sum(ledger.devices[d].external_bytes for d in best)
    where = ", ".join(f"GPU {d}: {gib(max(0, room(d)))} free" for d in sorted(best))
    return Refuse(INSUFFICIENT_GPU, f"needs {per_card}, but not now ({where}); "
                  f"{_holders_text(holders, other)}", need_bytes, free, tuple(holders))


def claim(need_bytes: int, n_devices: int, ledger: GpuLedger, key: str, *,
          declared_bytes: int | None = None, allowed: Collection[int] | None = None,
          ) -> tuple[GpuLedger, Admit] | Refuse:
    """``admit`` and, when admitted, ``reserve`` on the chosen cards in the same step, so the
    decision and the claim see the same ledger."""
    decision = admit(need_bytes, n_devices, ledger, key=key, allowed=allowed)
    if isinstance(decision, Refuse):
        return decision
    result = reserve(ledger, key, decision.devices, need_bytes, declared_bytes)
    if isinstance(result, LedgerRefusal):  # cannot happen: admit checked the same figures
        raise AssertionError(f"admitted claim refused by the ledger: {result}")
    return result[0], decision


def admit_sleep(level: int, weights_bytes: int, host: HostLedger, key: str,
                ) -> HostLedger | Refuse:
    """A sleep at ``level``; admitted, the host ledger to keep. Level 1 claims ``weights_bytes``
    of host memory for ``key`` (release it with ``host_release`` on wake or stop); level 2 needs
    nothing and always fits."""
    if level == 2:
        return host
    if level != 1:
        raise ValueError(f"sleep level {level} is not 1 or 2")
    result = host_reserve(host, key, weights_bytes)
    if isinstance(result, HostRefusal):
        holders = tuple((k, b) for k, b in host.holders() if k != key)
        return Refuse(INSUFFICIENT_HOST, f"a level-1 sleep moves {gib(weights_bytes)} of weights "
                      f"to host memory, but only {gib(result.free)} is free "
                      f"({gib(host.usable_bytes)} usable, {gib(host.external_bytes)} used by "
                      f"other processes); {_holders_text(list(holders), 0)}; a level-2 sleep "
                      f"needs no host memory", weights_bytes, result.free, holders)
    return result
