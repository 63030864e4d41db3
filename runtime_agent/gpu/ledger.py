"""The GPU memory ledger: who holds, or has claimed, how much of every card. Pure values, no I/O.

Every change returns a new ``GpuLedger``; the agent keeps the current one in one place and applies
changes without an ``await`` in between, so a claim is decided on the ledger it lands in.

Per card, ``usable = total - reserve`` and ``committed = external + sum(charges)``:

* ``external`` is memory no holding accounts for (other processes, the driver's own), measured
  from the last sample (``attribution.unattributed_bytes``).
* An engine's charge on a card is ``max(claim, base)``. The claim is a reservation made before a
  start or a wake (claim first: it is charged the moment it is granted, so two claims never spend
  the same free bytes). The base is what the running engine holds: its latest measurement, or
  its declaration (``maximum_footprint_bytes + kv_floor_bytes``, the seed's perGPU) until a
  measurement exists. A sleeping engine keeps its latest measurement (the awake one is an upper
  bound: sleep only frees) until its sleeping footprint is measured; never measured, it is
  charged its declaration. Unknown is never charged as 0.
* ``reserve`` refuses a claim that does not fit; ``measure`` and ``declare`` record reality and
  never refuse (reality may exceed the budget, and then every further claim is refused).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from msgspec import Struct, field
from msgspec.structs import replace

from runtime_agent.gpu.attribution import EngineMemory
from runtime_agent.gpu.model import Device


class DeviceBudget(Struct, frozen=True):
    index: int
    total_bytes: int
    reserve_bytes: int = 0
    external_bytes: int = 0

    @property
    def usable_bytes(self) -> int:
        return max(0, self.total_bytes - self.reserve_bytes)


class Holding(Struct, frozen=True):
    """One engine's hold on its cards; every figure is per device."""

    key: str
    devices: tuple[int, ...]
    declared_bytes: int
    claim_bytes: int = 0
    measured: Mapping[int, int] = field(default_factory=dict)
    awake_bytes: Mapping[int, int] = field(default_factory=dict)
    running: bool = False  # a process exists that may hold memory beyond the claim
    sleeping: bool = False

    def base(self, device: int) -> int:
        return self.measured.get(device, self.declared_bytes) if self.running else 0

    def charge(self, device: int) -> int:
        return max(self.claim_bytes, self.base(device)) if device in self.devices else 0

    def wake_need(self, device: int) -> int:
        """What a wake claims back on ``device``: the last awake measurement, else the declaration."""
        return self.awake_bytes.get(device, self.declared_bytes)


class GpuLedger(Struct, frozen=True):
    devices: Mapping[int, DeviceBudget]
    holdings: Mapping[str, Holding] = field(default_factory=dict)

    def charge(self, key: str, device: int) -> int:
        holding = self.holdings.get(key)
        return 0 if holding is None else holding.charge(device)

    def committed(self, device: int) -> int:
        budget = self.devices[device]
        return budget.external_bytes + sum(h.charge(device) for h in self.holdings.values())

    def room(self, device: int) -> int:
        """Usable bytes not committed; negative when reality already exceeds the budget."""
        return self.devices[device].usable_bytes - self.committed(device)

    def free(self, device: int) -> int:
        return max(0, self.room(device))

    def holders(self, devices: Iterable[int]) -> list[tuple[str, int]]:
        """Engines charged on ``devices`` with their bytes there, largest first (then by key)."""
        wanted = set(devices)
        totals = [(k, sum(h.charge(d) for d in wanted)) for k, h in self.holdings.items()]
        return sorted(((k, b) for k, b in totals if b > 0), key=lambda kb: (-kb[1], kb[0]))


class Reservation(Struct, frozen=True):
    key: str
    devices: tuple[int, ...]
    bytes_per_device: int


class LedgerRefusal(Struct, frozen=True):
    """A claim that does not fit: on ``device`` it needs ``needed`` more bytes, ``free`` remain."""

    key: str
    device: int
    needed: int
    free: int


# ---- building and observing -----------------------------------------------------------------

def new_ledger(totals: Mapping[int, int], reserve_bytes: int = 0) -> GpuLedger:
    """An empty ledger for cards of these sizes (index -> total bytes)."""
    if reserve_bytes < 0:
        raise ValueError("reserve_bytes must not be negative")
    return GpuLedger({i: DeviceBudget(i, t, reserve_bytes) for i, t in sorted(totals.items())})


def ledger_for(devices: Iterable[Device], reserve_bytes: int = 0) -> GpuLedger:
    return new_ledger({d.index: d.total_bytes for d in devices}, reserve_bytes)


def observe(ledger: GpuLedger, devices: Iterable[Device], external: Mapping[int, int],
            reserve_bytes: int | None = None) -> GpuLedger:
    """Take card sizes and the memory held outside the ledger (``unattributed_bytes``) from a
    sample. Cards the sample lacks (a failed sample) keep their last figures; a card new to the
    ledger gets ``reserve_bytes`` (default: the reserve of the ledger's other cards)."""
    budgets = dict(ledger.devices)
    default_reserve = reserve_bytes if reserve_bytes is not None else max(
        (b.reserve_bytes for b in budgets.values()), default=0)
    for device in devices:
        old = budgets.get(device.index)
        reserve = old.reserve_bytes if old is not None and reserve_bytes is None \
            else default_reserve
        budgets[device.index] = DeviceBudget(device.index, device.total_bytes, reserve,
                                             external.get(device.index, 0))
    return replace(ledger, devices=budgets)


def _with(ledger: GpuLedger, holding: Holding | None, key: str) -> GpuLedger:
    holdings = dict(ledger.holdings)
    if holding is None:
        holdings.pop(key, None)
    else:
        holdings[key] = holding
    return replace(ledger, holdings=holdings)


def _check_devices(ledger: GpuLedger, devices: tuple[int, ...]) -> None:
    unknown = [d for d in devices if d not in ledger.devices]
    if not devices or unknown or len(set(devices)) != len(devices):
        raise ValueError(f"devices {list(devices)} are not distinct cards of this ledger "
                         f"(cards: {sorted(ledger.devices)})")


def _as_devices(devices: int | Iterable[int]) -> tuple[int, ...]:
    return (devices,) if isinstance(devices, int) else tuple(devices)


# ---- claims ---------------------------------------------------------------------------------

def reserve(ledger: GpuLedger, key: str, devices: int | Iterable[int], bytes_per_device: int,
            declared_bytes: int | None = None) -> tuple[GpuLedger, Reservation] | LedgerRefusal:
    """Claim ``bytes_per_device`` on each device for ``key`` (all or nothing).

    A new key gets a holding declared at ``declared_bytes`` (default: the claim). For an existing
    key (a wake) the devices must be its own and its current charge counts as already held, so
    only the growth must fit. The claim replaces any earlier claim of the key."""
    devs = _as_devices(devices)
    _check_devices(ledger, devs)
    if bytes_per_device < 0:
        raise ValueError("bytes_per_device must not be negative")
    old = ledger.holdings.get(key)
    if old is None:
        new = Holding(key, devs, bytes_per_device if declared_bytes is None else declared_bytes,
                      claim_bytes=bytes_per_device)
    elif set(devs) != set(old.devices):
        raise ValueError(f"{key!r} holds devices {list(old.devices)}, not {list(devs)}")
    else:
        new = replace(old, claim_bytes=bytes_per_device,
                      declared_bytes=old.declared_bytes if declared_bytes is None
                      else declared_bytes)
    for device in devs:
        growth = new.charge(device) - (old.charge(device) if old else 0)
        if growth > 0 and growth > ledger.room(device):
            return LedgerRefusal(key, device, growth, ledger.free(device))
    return _with(ledger, new, key), Reservation(key, devs, bytes_per_device)


def release(ledger: GpuLedger, key: str) -> GpuLedger:
    """Drop the key's claim (its start or wake failed or was cancelled). A holding whose engine
    never came up disappears; a running or sleeping engine keeps its base charge."""
    holding = ledger.holdings.get(key)
    if holding is None:
        return ledger
    return _with(ledger, replace(holding, claim_bytes=0) if holding.running else None, key)


def forget(ledger: GpuLedger, key: str) -> GpuLedger:
    """Remove the key entirely: its engine stopped and holds nothing."""
    return _with(ledger, None, key)


# ---- reality --------------------------------------------------------------------------------

def declare(ledger: GpuLedger, key: str, devices: int | Iterable[int], declared_bytes: int,
            sleeping: bool = False) -> GpuLedger:
    """Record an engine that already runs (a re-adopted one): charged its declaration until it is
    measured. Never refused: the memory is already held."""
    devs = _as_devices(devices)
    _check_devices(ledger, devs)
    old = ledger.holdings.get(key)
    holding = Holding(key, devs, declared_bytes, running=True, sleeping=sleeping) if old is None \
        else replace(old, declared_bytes=declared_bytes, running=True, sleeping=sleeping)
    return _with(ledger, holding, key)


def _per_device(holding: Holding, measured: int | Mapping[int, int | None] | EngineMemory | None,
                ) -> dict[int, int]:
    if measured is None:
        return {}
    if isinstance(measured, EngineMemory):
        measured = measured.per_device
    if isinstance(measured, int):
        base, extra = divmod(measured, len(holding.devices))
        return {d: base + (1 if i < extra else 0) for i, d in enumerate(holding.devices)}
    return {d: b for d, b in measured.items() if b is not None and d in holding.devices}


def refresh(ledger: GpuLedger, key: str,
            measured: int | Mapping[int, int | None] | EngineMemory | None) -> GpuLedger:
    """Record a measurement while the key's claim stays in force (periodic samples during a start
    or wake must not give away bytes the engine is about to allocate). Unknown values (None)
    leave the previous figure. An int is the total, split evenly over the key's devices."""
    holding = ledger.holdings.get(key)
    if holding is None:
        raise KeyError(f"no holding for {key!r}: reserve or declare it first")
    values = _per_device(holding, measured)
    new = replace(holding, running=True, measured={**holding.measured, **values})
    if not holding.sleeping:
        new = replace(new, awake_bytes={**holding.awake_bytes, **values})
    return _with(ledger, new, key)


def measure(ledger: GpuLedger, key: str,
            measured: int | Mapping[int, int | None] | EngineMemory | None) -> GpuLedger:
    """The engine reached a steady state (ready, awake or asleep): its measurement replaces its
    claim and its declaration. With nothing measurable (None) the declaration stays in force."""
    ledger = refresh(ledger, key, measured)
    return _with(ledger, replace(ledger.holdings[key], claim_bytes=0), key)


def set_sleeping(ledger: GpuLedger, key: str, sleeping: bool) -> GpuLedger:
    """Mark the engine asleep (when its sleep call starts, so figures taken mid-sleep are not
    mistaken for its awake footprint) or awake (when its wake finished, before ``measure``).
    Its charge changes only with the next measurement; a wake claims first with ``reserve``."""
    holding = ledger.holdings.get(key)
    if holding is None:
        raise KeyError(f"no holding for {key!r}")
    return _with(ledger, replace(holding, sleeping=sleeping), key)
