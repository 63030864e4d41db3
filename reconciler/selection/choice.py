"""The per-call choice for a request to a route (the seed's ``CallPlanner.place``), pure.

Given the route's ranked candidates and a fresh ``View``, ``choose`` returns what to do, and
the caller does it (forwards, holds on a queue, claims the plan and wakes, starts or releases):

0. Refusals first (``refusals``): a route with no candidate is ``ZeroMatch``; the preferred
   candidate for this call is the first in order that fits some GPU and whose context holds
   the call (so an over-long prompt is refused before anything is woken or started): none fits
   any GPU is ``ModelTooLarge``, none holds the prompt is ``PromptTooLarge``.
1. ``warm``: a warm copy (active, a free slot, not another plan's victim) of a candidate whose
   score is at least the preferred one's less the route's tolerance, the preferred first, then
   by score; of one candidate's copies the least loaded.
2. ``converged``: a copy of an in-tolerance candidate being woken or started now: the call
   waits for that copy instead of bringing up a second model.
3. ``woken`` / ``started``: the preferred candidate brought up now where the GPU's budget
   already holds it (free memory, less live plans' loads, plus their victims' credit), the
   cheaper by bring-up time (measured, else size at 1 GiB/s).
4. The queue-or-unload decision in seconds (``delay``): the queue option is the shortest
   ``queue_wait`` over the warm copies of in-tolerance candidates; the unload option is, over
   the preferred candidate's dormant copies on GPUs that can hold it, the cheapest bring-up plus
   the victims' costs (``victims.choose_victims``). ``queued`` when the queue is no longer than
   unloading, ``made-room`` when unloading is cheaper or the only way, ``Busy`` when neither
   exists (hold the call; the next state change retries).

A ``woken``, ``started`` or ``made-room`` choice reserves memory before anything is released:
``plan_for`` builds its plan, and ``Book.claim`` admits it or not (claim first, then release).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from reconciler.selection.candidates import Ranked, fits
from reconciler.selection.delay import bring_up, queue_wait, queue_wins, victim_cost
from reconciler.selection.refusals import (
    Busy,
    ModelTooLarge,
    PromptNeed,
    PromptTooLarge,
    Refusal,
    ZeroMatch,
    holds,
)
from reconciler.selection.reservations import Plan
from reconciler.selection.route_spec import Route
from reconciler.selection.victims import Occupant, choose_victims
from reconciler.selection.view import DORMANT, LOADING, Copy, CopyState, View


class Kind(StrEnum):
    WARM = "warm"
    CONVERGED = "converged"
    QUEUED = "queued"
    WOKEN = "woken"
    STARTED = "started"
    MADE_ROOM = "made-room"


@dataclass(frozen=True)
class Choice:
    """What to do: serve ``candidate`` (a claim name) on its copy ``engine`` (on ``agent``,
    ``gpu``), by ``kind``; ``expected_s``: the expected delay before it can start; ``victims``:
    the models to release first (made-room), with the bytes each frees; ``needs``: the bytes
    the plan reserves on the GPU (woken, started, made-room)."""

    kind: Kind
    candidate: str
    engine: str
    agent: str
    gpu: str
    score: float
    expected_s: float = 0.0
    victims: tuple[tuple[str, int], ...] = ()
    needs: int = 0

    @property
    def victim_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.victims)


def _at(kind: Kind, r: Ranked, c: Copy, expected: float = 0.0,
        victims: Sequence[Occupant] = ()) -> Choice:
    return Choice(kind, r.name, c.engine, c.agent, c.gpu, r.score, expected,
                  tuple((v.name, v.frees) for v in victims),
                  c.needs if kind in (Kind.WOKEN, Kind.STARTED, Kind.MADE_ROOM) else 0)


def _preferred(route: Route, ranked: Sequence[Ranked], view: View, prompt: PromptNeed | None
               ) -> int | Refusal:
    """The index of this call's preferred candidate, or the refusal when there is none."""
    if not ranked:
        return ZeroMatch(route.name, route.require.describe())
    largest = view.largest_card
    widest: int | None = None
    any_fits = False
    for i, r in enumerate(ranked):
        if not fits(r.claim, largest):
            continue
        any_fits = True
        if holds(r.claim.context, prompt, r.claim.engine):
            return i
        if r.claim.context is not None:
            widest = max(widest or 0, r.claim.context)
    if not any_fits or prompt is None or widest is None:
        top = ranked[0]
        return ModelTooLarge(route.name, top.name, top.claim.footprint or 0, largest or 0)
    return PromptTooLarge(route.name, prompt, widest)


def in_tolerance(route: Route, ranked: Sequence[Ranked], at: int, view: View,
                 prompt: PromptNeed | None) -> list[Ranked]:
    """The preferred candidate, then every later one within the tolerance that fits and holds
    the call, in order (after its first entry the ranking is by score, and every entry before
    ``at`` was passed over, so the first below the threshold ends the list)."""
    pref = ranked[at]
    floor = pref.score - route.tolerance
    out = [pref]
    largest = view.largest_card
    for r in ranked[at + 1:]:
        if r.score < floor:
            break
        if fits(r.claim, largest) and holds(r.claim.context, prompt, r.claim.engine):
            out.append(r)
    return out


def choose(route: Route, ranked: Sequence[Ranked], view: View,
           prompt: PromptNeed | None = None) -> Choice | Refusal:
    """What to do with one call to ``route`` now (see the module's docstring)."""
    at = _preferred(route, ranked, view, prompt)
    if not isinstance(at, int):
        return at
    tol = in_tolerance(route, ranked, at, view, prompt)
    planned = view.planned
    copies = view.copies
    for r in tol:  # 1. warm
        warm = [c for c in copies.get(r.name, ()) if c.state is CopyState.ACTIVE
                and c.free_slot and c.engine not in planned]
        if warm:
            return _at(Kind.WARM, r, min(warm, key=lambda c: (len(c.in_flight) + c.queued,
                                                             c.engine)))
    for r in tol:  # 2. converge on a copy coming up
        for c in copies.get(r.name, ()):
            if c.state in LOADING and c.engine not in planned:
                return _at(Kind.CONVERGED, r, c)
    pref = tol[0]
    dormant = [c for c in copies.get(pref.name, ()) if c.state in DORMANT]
    now_options = [(bring_up(c.bring_up_s, c.size), c.state is CopyState.STOPPED, c.engine, c)
                   for c in dormant if _room_now(view, c)]
    if now_options:  # 3. bring the preferred up where the budget holds it
        secs, _, _, c = min(now_options, key=lambda o: o[:3])
        return _at(Kind.STARTED if c.state is CopyState.STOPPED else Kind.WOKEN, pref, c, secs)
    queue = _queue_option(tol, view)  # 4. queue or unload
    unload = _unload_option(pref, dormant, view)
    if queue_wins(queue[0] if queue else None, unload[0] if unload else None):
        assert queue is not None
        return _at(Kind.QUEUED, queue[1], queue[2], queue[0])
    if unload is not None:
        secs, c, victims = unload
        return _at(Kind.MADE_ROOM, pref, c, secs, victims)
    return Busy(route.name, pref.name, queue[0] if queue else None)


def _shortfall(view: View, c: Copy) -> int | None:
    """Bytes still missing on ``c``'s GPU for it to come up under the book's budget (live
    plans' loads there plus this one, against free memory plus their victims' credit); None
    when its GPU is not in the view or could never hold it."""
    gpu = view.gpus.get(c.gpu)
    if gpu is None or (gpu.usable is not None and c.needs > gpu.usable):
        return None
    book = view.book
    return book.pending(gpu.id) + c.needs - gpu.free - book.credit(gpu.id, gpu.resident)


def _room_now(view: View, c: Copy) -> bool:
    short = _shortfall(view, c)
    return short is not None and short <= 0


def _queue_option(tol: Sequence[Ranked], view: View) -> tuple[float, Ranked, Copy] | None:
    best: tuple[float, int, str, Ranked, Copy] | None = None
    for i, r in enumerate(tol):
        for c in view.copies.get(r.name, ()):
            if c.state is not CopyState.ACTIVE or c.engine in view.planned:
                continue
            wait = queue_wait(c.in_flight, c.queued, c.slots, c.latency_s, view.now)
            if best is None or (wait, i, c.engine) < best[:3]:
                best = (wait, i, c.engine, r, c)
    return None if best is None else (best[0], best[3], best[4])


def _unload_option(pref: Ranked, dormant: Sequence[Copy], view: View
                   ) -> tuple[float, Copy, tuple[Occupant, ...]] | None:
    best: tuple[float, str, Copy, tuple[Occupant, ...]] | None = None
    for c in dormant:
        short = _shortfall(view, c)
        if short is None:
            continue
        gpu = view.gpus[c.gpu]
        victims = choose_victims(gpu.occupants, short, view.now, view.idle_after_s,
                                 view.planned | {c.engine})
        if victims is None:
            continue
        cost = bring_up(c.bring_up_s, c.size) + sum(
            victim_cost(v.reload_size, v.demand, v.unload_s, v.reload_s) for v in victims)
        if best is None or (cost, c.engine) < best[:2]:
            best = (cost, c.engine, c, victims)
    return None if best is None else (best[0], best[2], best[3])


def plan_for(choice: Choice, plan_id: str, expires_at: float) -> Plan | None:
    """The reservation a choice needs before it brings anything up (None: it needs none)."""
    if choice.kind not in (Kind.WOKEN, Kind.STARTED, Kind.MADE_ROOM):
        return None
    return Plan(plan_id, choice.gpu, choice.candidate, choice.needs, expires_at,
                dict(choice.victims))
