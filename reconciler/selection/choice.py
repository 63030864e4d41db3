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
   cheaper by bring-up time (measured, else size at 1 GiB/s). In a view that does not know the
   memory (``View.room_unknown``: the door's), that bring-up is weighed against the queue
   option of step 4 instead (``queued`` when the queue is no longer).
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

from reconciler.selection.candidates import Candidates, Ranked, fits
from reconciler.selection.delay import bring_up, queue_wins, victim_cost
from reconciler.selection.refusals import (
    Busy,
    ModelTooLarge,
    PromptNeed,
    PromptTooLarge,
    Refusal,
    ZeroMatch,
    MOST,
    context_needed,
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


def _preferred(route: Route, cands: Candidates, view: View, prompt: PromptNeed | None
               ) -> int | Refusal:
    """The index of this call's preferred candidate, or the refusal when there is none."""
    ranked = cands.ranked
    if not ranked:
        return ZeroMatch(route.name, route.require.describe())
    largest = view.largest_card
    if (prompt is not None and cands.widest is not None
            and context_needed(prompt, "ollama") > cands.widest
            and (largest is None or cands.smallest is None or cands.smallest <= largest)):
        return PromptTooLarge(route.name, prompt, cands.widest)  # none holds it, one fits
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


def in_tolerance(route: Route, cands: Candidates, at: int, view: View,
                 prompt: PromptNeed | None) -> tuple[tuple[str, ...], frozenset[str]]:
    """The names of the preferred candidate, then every later one within the tolerance that
    fits and holds the call, in order (after its first entry the ranking is by score, and
    every entry before ``at`` was passed over, so the first below the threshold ends it)."""
    ranked = cands.ranked
    largest = view.largest_card
    if (at == 0 and route.tolerance == cands.tolerance
            and (prompt is None or cands.narrowest is None
                 or context_needed(prompt, MOST) <= cands.narrowest)
            and (largest is None or cands.largest is None or cands.largest <= largest)):
        # every one of the run fits and holds the call
        return cands.names[:cands.tolerance_end], cands.tolerance_set
    pref = ranked[at]
    floor = pref.score - route.tolerance
    out = [pref.name]
    for r in ranked[at + 1:]:
        if r.score < floor:
            break
        if fits(r.claim, largest) and holds(r.claim.context, prompt, r.claim.engine):
            out.append(r.name)
    return tuple(out), frozenset(out)


def choose(route: Route, cands: Candidates, view: View,
           prompt: PromptNeed | None = None) -> Choice | Refusal:
    """What to do with one call to ``route`` now (see the module's docstring)."""
    at = _preferred(route, cands, view, prompt)
    if not isinstance(at, int):
        return at
    tol, tol_set = in_tolerance(route, cands, at, view, prompt)
    planned = view.planned
    index = view.index
    ranked, position = cands.ranked, cands.position
    for name in filter(index.warm.__contains__, tol) if index.warm else ():  # 1. warm
        for c in index.warm[name]:
            if c.engine not in planned:
                return _at(Kind.WARM, ranked[position[name]], c)
    for name in filter(index.loading.__contains__, tol) if index.loading else ():  # 2. converge
        for c in index.loading[name]:
            if c.engine not in planned:
                return _at(Kind.CONVERGED, ranked[position[name]], c)
    pref = ranked[at]
    dormant = [(c, _shortfall(view, c)) for c in index.get(pref.name) if c.state in DORMANT]
    now_options = [(bring_up(c.bring_up_s, c.size), c.state is CopyState.STOPPED, c.engine, c)
                   for c, short in dormant if short is not None and short <= 0]
    if now_options:  # 3. bring the preferred up where the budget holds it
        secs, _, _, c = min(now_options, key=lambda o: o[:3])
        queue = _queue_option(cands, tol_set, view) if view.room_unknown else None
        if queue is not None and queue_wins(queue[0], secs):  # the room may not be free
            return _at(Kind.QUEUED, queue[1], queue[2], queue[0])
        return _at(Kind.STARTED if c.state is CopyState.STOPPED else Kind.WOKEN, pref, c, secs)
    queue = _queue_option(cands, tol_set, view)  # 4. queue or unload
    unload = _unload_option(dormant, view)
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
    if not book.plans:
        return c.needs - gpu.free
    return book.pending(gpu.id) + c.needs - gpu.free - book.credit(gpu.id, gpu.resident)


def _queue_option(cands: Candidates, tol: frozenset[str], view: View
                  ) -> tuple[float, Ranked, Copy] | None:
    """The busy warm copy of an in-tolerance candidate a call could start on soonest (ties:
    the better candidate, then the engine's name). A copy's wait is its backlog plus what is
    left of its soonest call, which is at least the clock value its backlog clears less now:
    read in that order, the first copy whose lower bound exceeds the best wait ends the scan."""
    planned, now, position = view.planned, view.now, cands.position
    best: tuple[float, int, str] | None = None
    for clears, soonest_end, backlog, name, engine in view.index.queue_order:
        if best is not None and clears - now > best[0]:
            break
        if name not in tol or engine in planned:
            continue
        key = (backlog + (soonest_end - now if soonest_end > now else 0.0), position[name],
               engine)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    r = cands.ranked[best[1]]
    return best[0], r, view.index.copy_of(r.name, best[2])


def _unload_option(dormant: Sequence[tuple[Copy, int | None]], view: View
                   ) -> tuple[float, Copy, tuple[Occupant, ...]] | None:
    """The cheapest plan that releases idle models so a dormant copy of the preferred
    candidate can come up: its bring-up time plus each victim's cost."""
    best: tuple[float, str, Copy, tuple[Occupant, ...]] | None = None
    for c, short in dormant:
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
