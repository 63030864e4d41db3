"""Requests whose ``model`` names a ``ModelRoute``: which claim serves this call (issue 24).

An exact name (a claim's modelName, an Ollama tag, a learned served name) never comes here:
``Door.serve`` looks the name up in the catalog first, as before, and only a name no claim
serves is looked up among the routes (one dict lookup), so exact-name requests do no extra work.

Per call, ``Router.choose`` runs the pure choice (``reconciler.selection.choice.choose``) over
the route's candidates (``candidates``: every claim its ``require`` admits, ranked, cached until
the claims or what the catalog learned change) and a ``View`` built from what the door already
reads: each candidate claim's ``plan.decide`` (status and route) says what its copy is:

| ``plan.decide`` | copy in the view |
|---|---|
| ``Forward`` | ``active``: its slots (``forwards.slots``), the door's forwards in flight to it and their latency average (``forwards.Forwards``) |
| ``Hold`` settle, start, move; ``Hold`` wake with a wake already asked | ``waking`` / ``starting`` (a call converges on it) |
| ``Hold`` wake or room of a sleeping claim | ``asleep`` |
| ``Hold`` with a kick (pending, not placed yet, activation failed) | ``stopped`` |
| ``Refuse`` | none |

Memory is read in two passes. The first view knows none: every dormant copy needs 0 bytes
(``View.room_unknown``), which is all a warm or converging choice needs. When the first pass
brings a claim up or queues (anything but warm or converged) and some dormant copy sleeps on
one GPU of an agent that answered, the second pass (``room``: ``reconciler.door.room``) gives
those copies their GPU as the agent's candidate has it: its free bytes, the wake's needs, and
the awake models that could be slept there with their demand. ``woken`` then means it fits
now, and ``made-room`` names the victims by the door's rule (least needed first: fewer held
calls, fewer intents, less recent use, least recently used), not the reconciler's (longest
idle). A ``woken`` or ``made-room`` choice over known room claims a plan in the router's
reservation book first (``reservations.Book``: two calls never spend one victim's memory; a
refused claim holds the call for the preferred claim instead) and releases it once the call is
admitted to its engine or ends (``release``), or when it expires (the door's hold bound). The victims ride on the wake
request (``WakeRequest.victims``): the reconciler sleeps those first, one at a time, where
they may still be slept, and the answer names them (``x-route-slept``). Copies whose room is
not known (stopped ones, engines on several GPUs, an agent not answering) keep the first
pass's rule: their bring-up is weighed against the queue at the soonest full warm copy in
tolerance (``queued`` when that queue is no longer, else ``woken`` or ``started``), and the
reconciler's own wake and placement make room if there is none. The door then carries the
choice out through ``Door.admit`` for the chosen claim alone: forward at once (warm, queued:
the engine queues it), or hold and ask the wake book (one wake for many requests) or kick the
claim. A held call chooses again on each change of the door's view (``Rechoice``): a
candidate that became warm takes it over.

The prompt is estimated (3.5 characters per token) only when the body is larger than the
narrowest known context of the candidates, so a candidate that cannot hold it is passed over; a
refusal on the estimate alone is never given: the chosen claim's engine counts exactly
(``Door.check_context``) before anything is woken.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from reconciler.desired import ClaimKey, Desired, key_text
from reconciler.door import plan, window
from reconciler.door.forwards import Forwards, slots
from reconciler.door.room import Room
from reconciler.replicas import route_name
from reconciler.selection.candidates import Candidates, ClaimInfo, rank
from reconciler.selection.choice import Choice, Kind, choose, plan_for
from reconciler.selection.refusals import Busy, PromptNeed, PromptTooLarge, Refusal, ZeroMatch
from reconciler.selection.reservations import Book
from reconciler.selection.route_spec import Route
from reconciler.selection.view import Copy, CopyState, GpuView, View

FAILED_SCHEDULING = "FailedScheduling"
NO_MATCHING_MODEL = "NoMatchingModel"
HELD = "held"
PLAN_TTL_S = 300.0  # a plan no call released lasts this long (the door passes its hold bound)
_FIRST_PASS = frozenset((Kind.WARM, Kind.CONVERGED))  # choices the room pass cannot change


def claim_infos(desired: Desired, context: Callable[[ClaimKey], int | None]
                ) -> dict[str, tuple[ClaimKey, ClaimInfo]]:
    """What selection reads of each claim, by claim key text."""
    out: dict[str, tuple[ClaimKey, ClaimInfo]] = {}
    for key, claim in desired.claims.items():
        fp = claim.per_gpu.maximum_footprint if claim.per_gpu is not None else None
        out[key_text(key)] = (key, ClaimInfo(key_text(key), claim.labels, fp, context(key),
                                             claim.engine))
    return out


def describe(desired: Desired, route: Route, cands: Candidates) -> dict[str, Any]:
    """A route as the reconciler's API and the door's model list show it: its candidates in
    order with their scores, and ``FailedScheduling`` while its require matches no claim."""
    listed = []
    for r in cands:
        claim = desired.claim(_key(r.name))
        listed.append({"claim": r.name, "model": claim.model_name if claim else r.name,
                       "score": r.score})
    zero = not cands.ranked
    selector = route.require.describe()
    return {"name": route.name, "namespace": route.namespace, "tolerance": route.tolerance,
            "candidates": listed,
            "conditions": [{"type": FAILED_SCHEDULING, "status": "True" if zero else "False",
                            "reason": NO_MATCHING_MODEL if zero else "Matched",
                            "message": ZeroMatch(route.name, selector).message if zero else
                            f"{len(listed)} candidate(s) match {{{selector}}}"}]}


def describe_routes(desired: Desired) -> dict[str, dict[str, Any]]:
    """Every route described, by name, its candidates ranked over every claim with the context
    its engine arguments declare: what ``GET /v1/modelroutes`` answers, and what the Kubernetes
    mode writes in each ModelRoute's status."""
    infos = claim_infos(desired, lambda k: (c := desired.claim(k)) is not None
                        and window.context_from_args(c.engine, c.engine_args) or None)
    return {name: describe(desired, route, rank(route, (i for _, i in infos.values())))
            for name, route in sorted(desired.routes.items())}


def _key(text: str) -> ClaimKey:
    namespace, _, name = text.partition("/")
    return namespace, name


@dataclass(frozen=True)
class Routed:
    """The choice for one call to a route, and the claim to serve it."""

    route: str
    kind: str  # the choice's kind; ``held`` when nothing can serve now (``Busy``)
    claim: ClaimKey
    model: str
    rechosen_from: ClaimKey | None = None  # the claim a held call was first choosing
    victims: tuple[str, ...] = ()  # made-room: models to sleep first (names on their agent)
    plan_id: str | None = None  # the plan claimed in the router's book (release it)

    def headers(self, agent: str) -> dict[str, str]:
        out = {"x-route": self.route, "x-route-claim": key_text(self.claim),
               "x-route-model": self.model, "x-route-agent": agent,
               "x-route-choice": self.kind}
        if self.rechosen_from is not None:
            out["x-route-rechosen-from"] = key_text(self.rechosen_from)
        if self.victims:
            out["x-route-slept"] = ",".join(self.victims)
        return out


class Router:
    """The per-call choice for routes, over the door's view of the claims."""

    def __init__(self, desired: Desired, context: Callable[[ClaimKey], int | None],
                 version: Callable[[], int], decide: Callable[[ClaimKey], plan.Decision],
                 wake_pending: Callable[[str], bool], now: Callable[[], float],
                 forwards: Forwards | None = None,
                 room: Callable[[ClaimKey, str], Room | None] = lambda key, model: None,
                 plan_ttl_s: float = PLAN_TTL_S) -> None:
        self._desired = desired
        self.forwards = forwards if forwards is not None else Forwards()
        self._context = context
        self._version = version  # what the catalog learned (contexts)
        self._decide = decide
        self._wake_pending = wake_pending
        self._now = now
        self._room = room  # a sleeping claim's GPU as the door sees it (``door.room``)
        self._plan_ttl = plan_ttl_s
        self.book = Book()  # the plans of woken and made-room choices over known room
        self._plan_ids = itertools.count(1)
        self._ranked: dict[str, tuple[int, int, Route, Candidates, int | None]] = {}

    def candidates(self, route: Route) -> tuple[Candidates, int | None]:
        """The route's ranked candidates and their narrowest known context (cached)."""
        claims, version = self._desired.claims_version, self._version()
        known = self._ranked.get(route.name)
        if known is not None and known[0] == claims and known[1] == version \
                and known[2] is route:
            return known[3], known[4]
        infos = claim_infos(self._desired, self._context)
        cands = rank(route, (info for _, info in infos.values()))
        contexts = [r.claim.context for r in cands if r.claim.context is not None]
        narrowest = min(contexts) if contexts else None
        if len(self._ranked) > 1024:
            self._ranked.clear()
        self._ranked[route.name] = (claims, version, route, cands, narrowest)
        return cands, narrowest

    def listing(self, allowed: Callable[[str], bool]) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the routes ``allowed`` says the caller may use: id = the
        route's name, its candidates in order with their scores (OpenAI clients ignore the
        extra fields)."""
        out: list[dict[str, Any]] = []
        for name, route in sorted(self._desired.routes.items()):
            if not allowed(name):
                continue
            shown = describe(self._desired, route, self.candidates(route)[0])
            out.append({"id": name, "object": "model", "created": 0, "owned_by": "warm-pool",
                        "root": name, "parent": None, "route": True,
                        "candidates": shown["candidates"], "conditions": shown["conditions"]})
        return out

    def view(self, cands: Candidates, names: tuple[str, ...], room: bool = False) -> View:
        """The view of ``names``' copies; ``room``: with the GPUs of sleeping copies where the
        door can read them (the second pass)."""
        return self._view(names, room)[0]

    def _view(self, names: tuple[str, ...], room: bool) -> tuple[View, dict[str, str]]:
        """``view``, and each occupant's model name on its agent by its name in the view."""
        copies: dict[str, tuple[Copy, ...]] = {}
        gpus: dict[str, GpuView] = {}
        models: dict[str, str] = {}
        unknown = False
        for name in names:
            copy = self._copy(_key(name), name, room)
            if copy is None:
                continue
            if isinstance(copy, tuple):  # a sleeping copy whose GPU is known
                copy, known = copy
                gpus[known.gpu.id] = known.gpu
                models.update(known.models)
            else:
                unknown = unknown or copy.state not in (CopyState.ACTIVE, CopyState.WAKING,
                                                        CopyState.STARTING)
                gpus.setdefault(copy.gpu, GpuView(copy.gpu, None, 0))
            copies[name] = (copy,)
        now = self._now()
        self.book = self.book.live(now)
        # occupants carry their own idle thresholds (``door.room``): the view's is 0
        return View(now, copies, gpus, self.book, idle_after_s=0.0,
                    room_unknown=unknown or not room), models

    def _copy(self, key: ClaimKey, name: str, room: bool = False
              ) -> Copy | tuple[Copy, Room] | None:
        d = self._decide(key)  # the claim by its best replica (``plan.choose``)
        if isinstance(d, plan.Refuse):
            return None
        claim = self._desired.claim(key)
        if isinstance(d, plan.Forward):
            fw = self.forwards
            return Copy(name, d.agent, d.agent, CopyState.ACTIVE,
                        slots=slots(claim.engine, claim.engine_args) if claim else 1,
                        in_flight=fw.in_flight(d.claim), latency_s=fw.latency(d.claim))
        model = route_name(claim.model_name if claim is not None else key[1], d.claim)
        if d.cause in (plan.SETTLE, plan.MOVE) or d.cause == plan.START and not d.kick:
            state = CopyState.STARTING if d.cause != plan.SETTLE else CopyState.WAKING
        elif d.wake:
            state = CopyState.WAKING if self._wake_pending(model) else CopyState.ASLEEP
        else:
            state = CopyState.STOPPED
        # its bring-up at 1 GiB/s of its footprint
        size = claim.per_gpu.maximum_footprint if claim and claim.per_gpu else 0
        known = self._room(d.claim, model) if room and state is CopyState.ASLEEP else None
        if known is not None:
            agent = known.gpu.id.rpartition("/")[0]
            return Copy(name, agent, known.gpu.id, state, needs=known.needs, size=size), known
        # each dormant copy on its own budget of 0 bytes
        return Copy(name, "", name, state, size=size)

    def choose(self, route: Route, endpoint: str, doc: Mapping[str, Any], body: bytes,
               book: bool = True, room: bool = True) -> Routed | Refusal:
        """The choice for one call. ``book``: claim the plan a woken or made-room choice over
        known room needs (the caller then ``release``s ``Routed.plan_id``); without it such a
        choice is only looked at. ``room``: look at memory too when the first pass finds
        nothing warm (a held call that only takes a warm candidate need not)."""
        cands, narrowest = self.candidates(route)
        prompt = _prompt(endpoint, doc, len(body), narrowest)
        names = cands.names if prompt is not None else cands.names[:max(1, cands.tolerance_end)]
        got, view, models = self._choose(route, cands, names, prompt, False)
        if room and (isinstance(got, Busy)
                     or isinstance(got, Choice) and got.kind not in _FIRST_PASS):
            got, view, models = self._choose(route, cands, names, prompt, True)
        if isinstance(got, Busy):  # hold for the preferred claim: its own path says why
            return self._routed(route, HELD, got.model)
        if not isinstance(got, Choice):
            return got
        if got.needs <= 0 or got.kind not in (Kind.WOKEN, Kind.MADE_ROOM):
            return self._routed(route, str(got.kind), got.candidate)
        if not book:
            return self._routed(route, str(got.kind), got.candidate,
                                tuple(models[v] for v in got.victim_names))
        return self._claim(route, got, view, models)

    def _choose(self, route: Route, cands: Candidates, names: tuple[str, ...],
                prompt: PromptNeed | None, room: bool
                ) -> tuple[Choice | Refusal, View, dict[str, str]]:
        view, models = self._view(names, room)
        got = choose(route, cands, view, prompt)
        if isinstance(got, PromptTooLarge):  # an estimate never refuses: the engine counts
            got = choose(route, cands, view, None)
        return got, view, models

    def _claim(self, route: Route, got: Choice, view: View, models: Mapping[str, str]
               ) -> Routed:
        """Claim first, then release: the plan joins the book, or the call is held for the
        preferred claim (another call's plan spent the room; it converges on that wake)."""
        gpu = view.gpus[got.gpu]
        plan = plan_for(got, f"door-{next(self._plan_ids)}", view.now + self._plan_ttl)
        assert plan is not None
        busy = {o.name for o in gpu.occupants if o.in_flight or o.demand.waiters}
        booked = self.book.claim(plan, gpu.free, gpu.resident, busy)
        if booked is None:
            return self._routed(route, HELD, got.candidate)
        self.book = booked
        return self._routed(route, str(got.kind), got.candidate,
                            tuple(models[v] for v in got.victim_names), plan.id)

    def release(self, plan_id: str | None) -> None:
        """The call a plan was claimed for ended: its room is no longer held for it."""
        if plan_id is not None:
            self.book = self.book.release(plan_id)

    def _routed(self, route: Route, kind: str, name: str, victims: tuple[str, ...] = (),
                plan_id: str | None = None) -> Routed:
        key = _key(name)
        claim = self._desired.claim(key)
        return Routed(route.name, kind, key, claim.model_name if claim is not None else key[1],
                      victims=victims, plan_id=plan_id)


class Rechoice:
    """A held route call's way back to the choice (a second choice while held).

    The door holds a routed call for its chosen claim; on every change of its view it calls
    ``again``. While the chosen claim is still coming up, only a *warm* in-tolerance candidate
    takes the call over (the wake already asked is not cancelled: other calls may converge on
    it, and the idle rule sleeps it again if none does). When the chosen claim is gone
    (deleted) or cannot serve (``lost``), whatever the choice says now is taken, a refusal
    included. ``routed`` is the choice that serves in the end (``rechosen_from`` set when it is
    not the first)."""

    def __init__(self, router: Router, route: Route, endpoint: str, doc: Mapping[str, Any],
                 body: bytes, first: Routed, usable: Callable[[ClaimKey], bool]) -> None:
        self._router, self._route = router, route
        self._endpoint, self._doc, self._body = endpoint, doc, body
        self._first = first
        self._usable = usable  # a claim whose engine serves this endpoint
        self.routed = first

    def again(self, lost: bool) -> Routed | Refusal | None:
        """The new choice, when it replaces the current one (None: keep waiting for it)."""
        got = self._router.choose(self._route, self._endpoint, self._doc, self._body,
                                  book=lost, room=lost)  # else only a warm one is taken
        if not isinstance(got, Routed):
            return got if lost else None
        if got.claim == self.routed.claim or not self._usable(got.claim) \
                or not lost and got.kind != str(Kind.WARM):
            self._router.release(got.plan_id)
            return None
        self._router.release(self.routed.plan_id)  # the first choice's room is not needed
        self.routed = Routed(got.route, got.kind, got.claim, got.model, self._first.claim,
                             got.victims, got.plan_id)
        return self.routed


def _prompt(endpoint: str, doc: Mapping[str, Any], body_bytes: int, narrowest: int | None
            ) -> PromptNeed | None:
    """The call's estimated need, when its body could exceed the narrowest context."""
    if endpoint not in window.COUNTED or not window.needs_count(body_bytes, narrowest):
        return None
    asked = window.output_limit(endpoint, doc)
    prompt = window.prompt_of(endpoint, doc, str(doc.get("model", "")))
    if prompt is None:
        return None
    tokens = prompt.token_ids if prompt.token_ids is not None else window.estimate(prompt.text)
    return PromptNeed(tokens, asked[1] if asked else None, prompt.param)
