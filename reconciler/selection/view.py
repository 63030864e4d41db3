"""The fresh state one per-call choice reads (the seed's provider state, mapped onto ours).

Kubemoot's provider is our agent's GPU (``GpuView``: its usable memory, what is free now, the
models on it that could be released); its resident or loading model is one engine of a claim
(``Copy``); its ticket bucket is our ``reservations.Book``. The door or the reconciler builds a
``View`` from the snapshots it already holds (``planning.state``: a copy's ``needs`` is what
``Gpu.room`` leaves out for it, an occupant's ``frees`` is its ``charge`` less what it keeps
asleep) and the door's own counters (requests in flight and queued, latency averages).

One name per engine: a copy's ``engine`` and the same engine's ``Occupant.name`` on its GPU are
the same string, so a copy that a plan will release (a victim in the book) is never taken as
warm, and a copy being brought up is never its own victim.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from types import MappingProxyType
from typing import TypeVar

from reconciler.selection.delay import queue_terms
from reconciler.selection.reservations import Book
from reconciler.selection.victims import Occupant

DEFAULT_IDLE_AFTER_S = 30.0  # the pool policy's sleepToMakeRoomAfterSeconds default
# A busy copy in the queue index: (when its backlog should clear, the clock value when its
# soonest call should end, its backlog in seconds, claim name, engine)
QueueEntry = tuple[float, float, float, str, str]


class CopyState(StrEnum):
    ACTIVE = "active"  # awake and on the route: serves now
    WAKING = "waking"  # a wake is under way (another call's plan, or the reconciler's)
    STARTING = "starting"  # a start is under way
    ASLEEP = "asleep"  # placed and asleep: can be woken where it is
    STOPPED = "stopped"  # placed, not running: can be started where it is placed


LOADING = frozenset((CopyState.WAKING, CopyState.STARTING))
DORMANT = frozenset((CopyState.ASLEEP, CopyState.STOPPED))


@dataclass(frozen=True)
class Copy:
    """One engine of a candidate claim on one GPU.

    ``slots``: requests it runs at once (vLLM ``--max-num-seqs``, Ollama's parallel);
    ``in_flight``: the start times (clock values) of the requests it runs now; ``queued``: calls
    waiting for it beyond those; ``latency_s``: its recent call latency (an exponentially
    weighted average; None: none seen). ``needs``: bytes it must add on its GPU to serve (to
    wake when asleep, to start when stopped); ``bring_up_s``: its measured wake or start time
    (None: not measured, then ``size`` bytes at 1 GiB/s).
    """

    engine: str
    agent: str
    gpu: str
    state: CopyState
    slots: int = 1
    in_flight: tuple[float, ...] = ()
    queued: int = 0
    latency_s: float | None = None
    needs: int = 0
    bring_up_s: float | None = None
    size: int = 0

    @property
    def free_slot(self) -> bool:
        return len(self.in_flight) + self.queued < self.slots

    @cached_property
    def queue_terms(self) -> tuple[float, float]:
        """``delay.queue_wait`` split into what does not depend on the clock: the clock value
        when its soonest call should end (-inf with a slot free) and the backlog behind it in
        seconds. Worked out once per copy: a copy is replaced when its requests change."""
        return queue_terms(self.in_flight, self.queued, self.slots, self.latency_s)


@dataclass(frozen=True)
class GpuView:
    """One GPU: ``usable`` bytes (None: not published, which never proves a model too large),
    ``free`` bytes now, and the models on it that could be released."""

    id: str
    usable: int | None
    free: int
    occupants: tuple[Occupant, ...] = ()

    @cached_property
    def resident(self) -> frozenset[str]:
        return frozenset(o.name for o in self.occupants)


class Copies:
    """Every candidate's copies (by claim name), indexed by what the per-call choice asks
    first: the warm copies with a free slot (least loaded first), the copies coming up, and the
    warm copies without a free slot. Built once; ``replaced`` gives the index with one
    candidate's copies changed at the cost of copying three dicts (done in C), so the caller
    keeps one index and replaces it on each change (a request started or ended, a snapshot)
    instead of building a fresh one per call. Never changed in place."""

    __slots__ = ("all", "warm", "loading", "busy", "queue_order")

    def __init__(self, by_name: Mapping[str, tuple[Copy, ...]] | None = None) -> None:
        self.all: dict[str, tuple[Copy, ...]] = dict(by_name or {})
        self.warm: dict[str, tuple[Copy, ...]] = {}
        self.loading: dict[str, tuple[Copy, ...]] = {}
        # per copy without a free slot, its entry in ``queue_order``
        self.busy: dict[str, tuple[QueueEntry, ...]] = {}
        # every busy copy, by when its backlog should clear (``queue_terms``' sum): the
        # queue option reads it in order and stops once no later copy can be sooner
        self.queue_order: list[QueueEntry] = []
        for name, copies in self.all.items():
            warm, loading, busy = _entries(name, copies)
            if warm:
                self.warm[name] = warm
            if loading:
                self.loading[name] = loading
            if busy:
                self.busy[name] = busy
                self.queue_order.extend(busy)
        self.queue_order.sort()

    def replaced(self, name: str, copies: tuple[Copy, ...]) -> Copies:
        """This index with ``name``'s copies now ``copies`` (``()``: it has none). Only the
        parts that change are copied; the rest is shared (none is ever changed in place)."""
        new = Copies.__new__(Copies)
        new.all = dict(self.all)
        if copies:
            new.all[name] = copies
        else:
            new.all.pop(name, None)
        warm, loading, busy = _entries(name, copies)
        new.warm = _put(self.warm, name, warm)
        new.loading = _put(self.loading, name, loading)
        old = self.busy.get(name, ())
        if old == busy:
            new.busy, new.queue_order = self.busy, self.queue_order
            return new
        new.busy = _put(self.busy, name, busy)
        new.queue_order = list(self.queue_order)
        for entry in old:
            del new.queue_order[bisect.bisect_left(new.queue_order, entry)]
        for entry in busy:
            bisect.insort(new.queue_order, entry)
        return new

    def copy_of(self, name: str, engine: str) -> Copy:
        return next(c for c in self.all[name] if c.engine == engine)

    def get(self, name: str, default: tuple[Copy, ...] = ()) -> tuple[Copy, ...]:
        return self.all.get(name, default)

    def __getitem__(self, name: str) -> tuple[Copy, ...]:
        return self.all[name]


@dataclass(frozen=True)
class View:
    """The state of the pool for one call: the clock, each candidate's copies (``Copies``, or
    a mapping by claim name that is indexed here), the GPUs by id, the reservation book, and
    the pool's sleepToMakeRoomAfterSeconds. ``room_unknown``: the GPUs' memory is not this
    view's to know (the door's view: room is made by the reconciler's wake and placement), so a
    dormant copy "fits now" without proving it was free, and its bring-up is weighed against
    the queue as an unload would be."""

    now: float
    copies: Copies | Mapping[str, tuple[Copy, ...]] = field(default_factory=Copies, hash=False)
    gpus: Mapping[str, GpuView] = field(default_factory=dict, hash=False)
    book: Book = field(default_factory=Book)
    idle_after_s: float = DEFAULT_IDLE_AFTER_S
    room_unknown: bool = False

    # worked out at construction (plain attributes: a call reads each a few times)
    largest_card: int | None = field(init=False, hash=False, compare=False)
    planned: frozenset[str] = field(init=False, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.copies, Copies):
            object.__setattr__(self, "copies", Copies(self.copies))
        if not isinstance(self.gpus, MappingProxyType):
            object.__setattr__(self, "gpus", MappingProxyType(dict(self.gpus)))
        known = [g.usable for g in self.gpus.values() if g.usable is not None]
        # the largest usable memory any GPU published (None: none did)
        object.__setattr__(self, "largest_card", max(known) if known else None)
        # models some live plan will release: neither warm nor a victim for anyone else
        object.__setattr__(self, "planned", self.book.planned_victims())

    @property
    def index(self) -> Copies:
        """The copies, indexed (``__post_init__`` made them a ``Copies``)."""
        assert isinstance(self.copies, Copies)
        return self.copies


_V = TypeVar("_V", tuple[Copy, ...], tuple[QueueEntry, ...])


def _entries(name: str, copies: tuple[Copy, ...]
             ) -> tuple[tuple[Copy, ...], tuple[Copy, ...], tuple[QueueEntry, ...]]:
    """``name``'s warm copies with a free slot (least loaded first), copies coming up, and
    queue entries of its warm copies without a free slot."""
    warm = tuple(sorted((c for c in copies if c.state is CopyState.ACTIVE and c.free_slot),
                        key=lambda c: (len(c.in_flight) + c.queued, c.engine)))
    loading = tuple(c for c in copies if c.state in LOADING)
    busy = tuple((c.queue_terms[0] + c.queue_terms[1], *c.queue_terms, name, c.engine)
                 for c in copies if c.state is CopyState.ACTIVE and not c.free_slot)
    return warm, loading, busy


def _put(index: dict[str, _V], name: str, value: _V) -> dict[str, _V]:
    """``index`` with ``name`` set to ``value`` (removed when empty): the same dict when that
    changes nothing, else a copy."""
    if index.get(name) == value or (not value and name not in index):
        return index
    out = dict(index)
    if value:
        out[name] = value
    else:
        del out[name]
    return out
