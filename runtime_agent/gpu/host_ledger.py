"""The host-memory ledger: room for the weights that level-1 sleeps move out of the GPU.

A level-1 sleep copies an engine's weights into (pinned) host memory; several sleeping 70B models
can exhaust the Pod's memory and get the whole Pod OOM-killed. So a level-1 sleep claims its
weights' bytes here first, exactly like a GPU claim: ``usable = total - reserve``, ``committed =
external + sum(holdings)``, and a claim that does not fit is refused. Pure values, no I/O:
``total`` is the Pod's limit (the cgroup memory limit in a container, else MemTotal) and
``external`` what everything but the held weights uses, both measured by the caller.
"""

from __future__ import annotations

from collections.abc import Mapping

from msgspec import Struct, field
from msgspec.structs import replace


class HostLedger(Struct, frozen=True):
    total_bytes: int
    reserve_bytes: int = 0
    external_bytes: int = 0
    holdings: Mapping[str, int] = field(default_factory=dict)  # key -> bytes held or claimed

    @property
    def usable_bytes(self) -> int:
        return max(0, self.total_bytes - self.reserve_bytes)

    @property
    def committed(self) -> int:
        return self.external_bytes + sum(self.holdings.values())

    @property
    def room(self) -> int:
        """Usable bytes not committed; negative when reality already exceeds the budget."""
        return self.usable_bytes - self.committed

    @property
    def free(self) -> int:
        return max(0, self.room)

    def holders(self) -> list[tuple[str, int]]:
        """Engines holding host memory, largest first (then by key)."""
        return sorted(((k, b) for k, b in self.holdings.items() if b > 0),
                      key=lambda kb: (-kb[1], kb[0]))


class HostRefusal(Struct, frozen=True):
    key: str
    needed: int
    free: int


def _set(ledger: HostLedger, key: str, value: int | None) -> HostLedger:
    holdings = dict(ledger.holdings)
    if value is None:
        holdings.pop(key, None)
    else:
        holdings[key] = value
    return replace(ledger, holdings=holdings)


def host_observe(ledger: HostLedger, total_bytes: int, external_bytes: int) -> HostLedger:
    """Take the Pod's memory limit and what is used outside the held weights from a measurement."""
    return replace(ledger, total_bytes=total_bytes, external_bytes=max(0, external_bytes))


def host_reserve(ledger: HostLedger, key: str, nbytes: int) -> HostLedger | HostRefusal:
    """Claim ``nbytes`` for ``key`` (replacing what it held): only the growth must fit."""
    if nbytes < 0:
        raise ValueError("nbytes must not be negative")
    growth = nbytes - ledger.holdings.get(key, 0)
    if growth > 0 and growth > ledger.room:
        return HostRefusal(key, growth, ledger.free)
    return _set(ledger, key, nbytes)


def host_measure(ledger: HostLedger, key: str, nbytes: int | None) -> HostLedger:
    """Record what the key is measured to hold, replacing its claim (never refused: the memory
    is already held, e.g. by a re-adopted sleeping engine); None keeps the previous figure."""
    if nbytes is None:
        return ledger
    return _set(ledger, key, max(0, nbytes))


def host_release(ledger: HostLedger, key: str) -> HostLedger:
    """The key holds no host memory any more (woke up, slept at level 2, stopped)."""
    return _set(ledger, key, None)
