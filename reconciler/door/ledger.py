"""Requests the door holds or forwards, counted per model, and the signal that wakes held ones.

``Ledger`` counts requests in flight per replica (``reconciler.replicas.route_name``: the
model name for a claim of one replica), every request from the moment the door picks the
replica until it has answered, held ones included; and requests held per model (waiting for a
wake, for room, for a start). The reconciler reads the first count before it puts a model
to sleep (``WorldReader.in_flight``): a model with a request in flight through the door is busy,
whatever its engine's own figures say yet. The second is bounded per model: past the bound a
new request is answered 503 at once instead of joining the wait.

Counts change only on the event loop and without an await between a decision and its count,
so the reconciler's last look before a sleep (also on the loop) sees every request that was
sent, or about to be sent, to the engine.

``Ticket`` is one request's place in the ledger (in flight for one model, held for one).

``Changes`` is how held requests learn that something moved: every claim status change and
every route hold taken or released bumps it, and each held request re-decides. A waiter takes
``next()`` *before* it looks at the world, so a change between its look and its wait still
wakes it.
"""

from __future__ import annotations

import asyncio


class Changes:
    """A broadcast: ``bump()`` wakes everyone who took ``next()`` before it."""

    def __init__(self) -> None:
        self.version = 0
        self._event: asyncio.Event | None = None

    def next(self) -> asyncio.Event:
        """The event the next bump sets."""
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def bump(self) -> None:
        self.version += 1
        event, self._event = self._event, None
        if event is not None:
            event.set()


class Ledger:
    """In-flight and held requests per claim model."""

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._held: dict[str, int] = {}

    def in_flight(self, model: str) -> int:
        return self._in_flight.get(model, 0)

    def held(self, model: str) -> int:
        return self._held.get(model, 0)

    def enter(self, model: str) -> None:
        self._in_flight[model] = self._in_flight.get(model, 0) + 1

    def leave(self, model: str) -> None:
        _down(self._in_flight, model)

    def try_hold(self, model: str, bound: int) -> bool:
        """Join the model's held requests unless ``bound`` of them are held already."""
        held = self._held.get(model, 0)
        if held >= bound:
            return False
        self._held[model] = held + 1
        return True

    def release(self, model: str) -> None:
        _down(self._held, model)

    def any_held(self) -> bool:
        """Whether some request is held (for any model): it may choose again on a change."""
        return bool(self._held)

    def models(self) -> list[str]:
        return sorted(self._in_flight.keys() | self._held.keys())


class Ticket:
    """One request's place in the ledger: in flight for a model, held for a model."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self.model: str | None = None  # in flight for this claim model
        self.held: str | None = None

    def enter(self, model: str) -> None:
        if self.model != model:
            self.leave()
            self._ledger.enter(model)
            self.model = model

    def hold(self, model: str, bound: int) -> bool:
        if self.held == model:
            return True
        self.unhold()
        if not self._ledger.try_hold(model, bound):
            return False
        self.held = model
        return True

    def unhold(self) -> None:
        if self.held is not None:
            self._ledger.release(self.held)
            self.held = None

    def leave(self) -> None:
        self.unhold()
        if self.model is not None:
            self._ledger.leave(self.model)
            self.model = None


def _down(counts: dict[str, int], model: str) -> None:
    left = counts.get(model, 0) - 1
    if left > 0:
        counts[model] = left
    else:
        counts.pop(model, None)
