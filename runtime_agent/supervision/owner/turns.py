"""A start's turn on its cards (``runtime_agent.gpu.gate``): the one it holds or waits for.

An engine that declared its footprint shares the turn with other declared starts there (the
ledger set its bytes aside); one that is measured has its cards alone. The turn is held until
the engine answers, or its start ends otherwise; a grant for a turn given back is void (its
token is not the current one).
"""

from __future__ import annotations

from runtime_agent.gpu.gate import DeviceGate, Turn


class TurnSlot:
    def __init__(self, gate: DeviceGate) -> None:
        self._gate = gate
        self._turn: Turn | None = None
        self._token = 0

    def request(self, devices: list[int], label: str, shared: bool) -> tuple[int, Turn]:
        """Give back any turn held, ask for a new one; its token and the turn."""
        self.end()
        self._token += 1
        self._turn = self._gate.request(devices, label=label, shared=shared)
        return self._token, self._turn

    def current(self, token: int) -> bool:
        return token == self._token

    @property
    def queued(self) -> bool:
        """A turn is asked for and not granted yet."""
        return self._turn is not None and not self._turn.granted.done()

    def end(self) -> None:
        if self._turn is not None:
            self._turn.release()
            self._turn = None

    def queued_because(self, devices: list[int], turn: Turn) -> str:
        cards = ", ".join(str(d) for d in devices)
        holders = self._gate.holders(devices)
        measured = [repr(name) for name, exclusive in holders if exclusive]
        if measured:
            why = f"{', '.join(measured)} is starting there and is measured alone"
        elif turn.exclusive:
            why = (f"it declared no per_gpu footprint, so it is measured alone once the "
                   f"{len(holders)} start(s) there are done")
        else:
            why = "a measured start waits there before it"
        return f"waiting for its turn on GPU {cards}: {why}"
