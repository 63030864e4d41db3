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

Memory is the reconciler's: every dormant copy needs 0 bytes in the door's view
(``View.room_unknown``), so bringing a dormant preferred claim up (its footprint at 1 GiB/s,
the seed's) is weighed against the queue at the soonest full warm copy in tolerance: ``queued``
when that queue is no longer, else ``woken`` or ``started``, and the reconciler's own wake and
placement make room if there is none (by its own victim rule). The door then carries the choice
out through ``Door.admit`` for the chosen claim alone: forward at once (warm, queued: the
engine queues it), or hold and ask the wake book (one wake for many requests) or kick the
claim. Not carried out yet: ``made-room`` with the door's planned victims (the reservation book
is not shared with the reconciler). A held call chooses again on each change of the door's
view (``Rechoice``): a candidate that became warm takes it over.

The prompt is estimated (3.5 characters per token) only when the body is larger than the
narrowest known context of the candidates, so a candidate that cannot hold it is passed over; a
refusal on the estimate alone is never given: the chosen claim's engine counts exactly
(``Door.check_context``) before anything is woken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from reconciler.desired import ClaimKey, Desired, key_text
from reconciler.door import plan, window
from reconciler.door.forwards import Forwards, slots
from reconciler.replicas import route_name
from reconciler.selection.candidates import Candidates, ClaimInfo, rank
from reconciler.selection.choice import Choice, Kind, choose
from reconciler.selection.refusals import Busy, PromptNeed, PromptTooLarge, Refusal, ZeroMatch
from reconciler.selection.route_spec import Route
from reconciler.selection.view import Copy, CopyState, GpuView, View

FAILED_SCHEDULING = "FailedScheduling"
NO_MATCHING_MODEL = "NoMatchingModel"
HELD = "held"


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

    def headers(self, agent: str) -> dict[str, str]:
        out = {"x-route": self.route, "x-route-claim": key_text(self.claim),
               "x-route-model": self.model, "x-route-agent": agent,
               "x-route-choice": self.kind}
        if self.rechosen_from is not None:
            out["x-route-rechosen-from"] = key_text(self.rechosen_from)
        return out


class Router:
    """The per-call choice for routes, over the door's view of the claims."""

    def __init__(self, desired: Desired, context: Callable[[ClaimKey], int | None],
                 version: Callable[[], int], decide: Callable[[ClaimKey], plan.Decision],
                 wake_pending: Callable[[str], bool], now: Callable[[], float],
                 forwards: Forwards | None = None) -> None:
        self._desired = desired
        self.forwards = forwards if forwards is not None else Forwards()
        self._context = context
        self._version = version  # what the catalog learned (contexts)
        self._decide = decide
        self._wake_pending = wake_pending
        self._now = now
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

    def view(self, cands: Candidates, names: tuple[str, ...]) -> View:
        copies: dict[str, tuple[Copy, ...]] = {}
        gpus: dict[str, GpuView] = {}
        for name in names:
            copy = self._copy(_key(name), name)
            if copy is not None:
                copies[name] = (copy,)
                gpus.setdefault(copy.gpu, GpuView(copy.gpu, None, 0))
        return View(self._now(), copies, gpus, room_unknown=True)

    def _copy(self, key: ClaimKey, name: str) -> Copy | None:
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
        # each dormant copy on its own budget of 0 bytes; its bring-up at 1 GiB/s of its footprint
        size = claim.per_gpu.maximum_footprint if claim and claim.per_gpu else 0
        return Copy(name, "", name, state, size=size)

    def choose(self, route: Route, endpoint: str, doc: Mapping[str, Any], body: bytes
               ) -> Routed | Refusal:
        cands, narrowest = self.candidates(route)
        prompt = _prompt(endpoint, doc, len(body), narrowest)
        names = cands.names if prompt is not None else cands.names[:max(1, cands.tolerance_end)]
        view = self.view(cands, names)
        got = choose(route, cands, view, prompt)
        if isinstance(got, PromptTooLarge):  # an estimate never refuses: the engine counts
            got = choose(route, cands, view, None)
        if isinstance(got, Busy):  # hold for the preferred claim: its own path says why
            return self._routed(route, HELD, got.model)
        if not isinstance(got, Choice):
            return got
        return self._routed(route, str(got.kind), got.candidate)

    def _routed(self, route: Route, kind: str, name: str) -> Routed:
        key = _key(name)
        claim = self._desired.claim(key)
        return Routed(route.name, kind, key, claim.model_name if claim is not None else key[1])


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
        got = self._router.choose(self._route, self._endpoint, self._doc, self._body)
        if not isinstance(got, Routed):
            return got if lost else None
        if got.claim == self.routed.claim or not self._usable(got.claim) \
                or not lost and got.kind != str(Kind.WARM):
            return None
        self.routed = Routed(got.route, got.kind, got.claim, got.model, self._first.claim)
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
