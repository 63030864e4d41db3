"""Turns on the cards for starts and wakes: declared ones share a card, measured ones have it alone.

vLLM sizes itself while it starts: it profiles a forward pass and takes the free memory it sees
on the card (``gpu_memory_utilization``) as its budget. Two such starts on one card at the same
moment see each other's allocations and both measure wrong; a start that allocates while
another is being measured spoils that measurement too. The ledger cannot help there: an engine
that declared nothing is charged nothing until a sample has measured it.

An engine that declared its footprint (``per_gpu``: maximum footprint + KV floor) is different:
admission has set its bytes aside in the ledger before it starts (claim first, so the sum of the
reservations on a card fits), and its KV cache is kvcached's elastic pool, bounded by its
segment's limit, not by what it measures free. Starts like that do not disturb each other, so
they may run at once on a card as long as the ledger admitted them; a measured start must still
run alone there. So a card is a readers/writer gate:

* a **shared** turn (a declared start, or a wake of known size) may hold a card together with
  other shared turns;
* an **exclusive** turn (a start sized by measuring it, or a wake of unknown size) holds its
  cards alone: nothing else starts or wakes on them meanwhile, in either direction.

Wakes: vLLM's ``/wake_up`` maps back the allocations its sleep released (its CuMemAllocator
pools) and profiles nothing, so its size is what the engine held awake; the broker claims that
back before the call (``claim_wake``: the last awake measurement, else the declaration). A wake
whose size the ledger knows is therefore shared; one it does not know (never measured awake,
nothing declared, so it claimed 0) is exclusive, like a measured start. Either way a wake still
waits for a measured start on its card, and a measured start waits for the wake: that
measurement must see no memory move but its own.

Guarantees (``CardTurns``, tested by properties in ``tests/test_gpu_gate.py``):

* No deadlock: a turn takes all its cards at once or waits holding none, so turns on overlapping
  card sets cannot wait for each other in a cycle; the first waiter only ever waits for holders.
* FIFO among conflicting turns: a turn is granted only when no holder and no earlier waiting turn
  conflicts with it (two turns conflict when they share a card and one is exclusive). So an
  exclusive turn is never passed by a later start on its cards, and a stream of declared starts
  cannot starve a measured one; shared turns never wait for each other.
* Turns on disjoint cards never wait for each other: cards proceed in parallel.

Not re-entrant: a task must not nest turns on a shared card. Releasing a waiting turn withdraws
it; releasing twice is harmless.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

from msgspec import Struct, field


class Ticket(Struct, eq=False):
    """One turn asked for: its cards, whether it needs them alone, and whose it is."""

    devices: frozenset[int]
    exclusive: bool
    label: str = ""


def conflict(a: Ticket, b: Ticket) -> bool:
    """Whether two turns may not hold their cards at the same time."""
    return bool(a.devices & b.devices) and (a.exclusive or b.exclusive)


class CardTurns(Struct):
    """The gate's bookkeeping, pure: who holds, who waits. Each change returns the turns it granted,
    in the order they were asked."""

    holding: list[Ticket] = field(default_factory=list)
    waiting: list[Ticket] = field(default_factory=list)

    def ask(self, ticket: Ticket) -> list[Ticket]:
        self.waiting.append(ticket)
        return self._grant()

    def done(self, ticket: Ticket) -> list[Ticket]:
        """The turn ended (held) or was withdrawn (waiting); unknown tickets change nothing."""
        if ticket in self.holding:
            self.holding.remove(ticket)
        elif ticket in self.waiting:
            self.waiting.remove(ticket)
        else:
            return []
        return self._grant()

    def _grant(self) -> list[Ticket]:
        granted: list[Ticket] = []
        still: list[Ticket] = []
        for ticket in self.waiting:
            if any(conflict(ticket, other) for other in (*self.holding, *still)):
                still.append(ticket)
            else:
                self.holding.append(ticket)
                granted.append(ticket)
        self.waiting = still
        return granted


class Turn:
    """One start's or wake's turn. ``granted`` is done once it holds its cards (at once when they
    were free); ``release`` ends it, or withdraws it while it waits."""

    def __init__(self, gate: DeviceGate, ticket: Ticket | None) -> None:
        self._gate = gate
        self._ticket = ticket
        self.granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if ticket is None:  # no cards: nothing to wait for
            self.granted.set_result(None)

    @property
    def exclusive(self) -> bool:
        return self._ticket is not None and self._ticket.exclusive

    def release(self) -> None:
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            self._gate._done(ticket)
        if not self.granted.done():
            self.granted.cancel()


class DeviceGate:
    def __init__(self) -> None:
        self._turns = CardTurns()
        self._futures: dict[int, Turn] = {}  # id(ticket) -> its turn

    def request(self, devices: Iterable[int], *, shared: bool = False, label: str = "") -> Turn:
        """Ask for a turn on ``devices`` now; granted at once when nothing conflicts."""
        wanted = frozenset(devices)
        if not wanted:
            return Turn(self, None)
        ticket = Ticket(wanted, not shared, label)
        turn = Turn(self, ticket)
        self._futures[id(ticket)] = turn
        self._settle(self._turns.ask(ticket))
        return turn

    @asynccontextmanager
    async def turn(self, devices: Iterable[int], *, shared: bool = False,
                   label: str = "") -> AsyncIterator[None]:
        """Hold the turn on ``devices`` for the body of the ``async with``."""
        turn = self.request(devices, shared=shared, label=label)
        try:
            await turn.granted
            yield
        finally:  # cancelled while waiting: withdrawn; granted just then: given back
            turn.release()

    def _done(self, ticket: Ticket) -> None:
        self._futures.pop(id(ticket), None)
        self._settle(self._turns.done(ticket))

    def _settle(self, granted: list[Ticket]) -> None:
        for ticket in granted:
            turn = self._futures.get(id(ticket))
            if turn is not None and not turn.granted.done():
                turn.granted.set_result(None)

    # ---- for the snapshot and for messages (never blocks) ----------------------------------

    def waiters(self, device: int | None = None) -> int:
        """Turns waiting (on ``device``, or on any card)."""
        return sum(1 for t in self._turns.waiting if device is None or device in t.devices)

    def busy(self) -> frozenset[int]:
        """Cards on which a start or wake holds a turn now."""
        return frozenset(d for t in self._turns.holding for d in t.devices)

    def holders(self, devices: Iterable[int]) -> list[tuple[str, bool]]:
        """(label, exclusive) of the turns holding any of ``devices``, in the order granted."""
        wanted = frozenset(devices)
        return [(t.label, t.exclusive) for t in self._turns.holding if t.devices & wanted]
