"""The room index (``planning.room_index``) kept current with what the reconciler sees.

An agent's entry is rebuilt only when something its candidate is made of changed: its snapshot
(a new fetch, or an answer of "not modified", is a new ``AgentObs``), its agent or pool
definition (the Pod's labels, the pool's policy), its reservations (``Reservations.version``),
or the figures of a claim one of its engines answers to (its perGPU, and whether it is being
measured: ``claim_changed``, every reconcile of a claim reports them). ``sync`` costs one
identity check per agent, and a rebuild per agent that changed, instead of a candidate per
agent per placement.

The entries are the candidates ``WorldReader.world`` would build from the same snapshots, so the
index's choice is the exhaustive scan's over those snapshots (the property test in
``tests/test_room_index.py`` checks the pure part; ``tests/test_room_book.py`` the upkeep).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from reconciler.desired import ClaimKey
from reconciler.model.manifests import AgentRef, WarmPool
from reconciler.observe import AgentObs
from reconciler.planning.room_index import RoomIndex
from reconciler.planning.state import Candidate

AgentDef = tuple[AgentRef, WarmPool]


class RoomBook:
    """The index, and what each entry was built from."""

    def __init__(self, ref: Callable[[str], AgentDef | None], version: Callable[[str], int],
                 build: Callable[[AgentObs, AgentRef, WarmPool], Candidate],
                 per_gpu: Callable[[ClaimKey], object]) -> None:
        self.index = RoomIndex()
        self._ref, self._version, self._build, self._per_gpu = ref, version, build, per_gpu
        self._inputs: dict[str, tuple[AgentObs, AgentDef, int]] = {}
        self._hosts: dict[ClaimKey, set[str]] = {}  # claim -> agents with an engine of it
        # what the entries counted each claim's engines by (its perGPU, and whether it was
        # being measured: ``WorldReader.figures``), compared for changes
        self._figures: dict[ClaimKey, object] = {}
        self._dirty: set[str] = set()
        self.rebuilds = 0

    def sync(self, observed: Mapping[str, AgentObs]) -> RoomIndex:
        """The index over exactly the agents of ``observed``, as of those snapshots."""
        for name in [n for n in self._inputs if n not in observed]:
            self._forget(name)
        for name, obs in observed.items():
            found = self._ref(name)
            if found is None:
                self._forget(name)
                continue
            was = self._inputs.get(name)
            if was is not None and name not in self._dirty and was[0] is obs \
                    and was[1] is found and was[2] == self._version(name):
                continue
            self.index.put(self._build(obs, *found))
            self.rebuilds += 1
            self._inputs[name] = (obs, found, self._version(name))  # after live() expired any
            self._dirty.discard(name)
            self._host(name, set(was[0].by_claim) if was is not None else set(),
                       set(obs.by_claim))
        return self.index

    def claim_changed(self, key: ClaimKey) -> None:
        """The claim was (re)read: the agents whose engines answer to it are rebuilt at the next
        ``sync`` if its perGPU is no longer what their entries counted."""
        hosts = self._hosts.get(key)
        if hosts and self._per_gpu(key) != self._figures.get(key):
            self._dirty |= hosts

    def _host(self, name: str, before: set[ClaimKey], after: set[ClaimKey]) -> None:
        for key in before - after:
            hosts = self._hosts.get(key)
            if hosts is not None:
                hosts.discard(name)
                if not hosts:
                    del self._hosts[key]
                    self._figures.pop(key, None)
        for key in after:
            hosts = self._hosts.setdefault(key, set())
            hosts.add(name)
            figures = self._per_gpu(key)
            if key in self._figures and self._figures[key] != figures:
                self._dirty |= hosts - {name}  # they counted the old figures
            self._figures[key] = figures

    def _forget(self, name: str) -> None:
        was = self._inputs.pop(name, None)
        self.index.drop(name)
        self._dirty.discard(name)
        if was is not None:
            self._host(name, set(was[0].by_claim), set())
