"""The door: routes each request by its model, holds it until the model serves, forwards it.

One request, start to end (``serve``):

1. its ``model`` names claims (``Catalog``: modelNames, Ollama tags, learned served names and
   LoRA adapters), else a ModelRoute (``routing``: one claim chosen per call); an unknown name,
   or one the API key may not use, is answered at once;
2. ``admit`` decides per call (``plan.decide`` per claim, ``plan.choose`` among them) and, while
   the model cannot serve, holds the request: it asks the reconciler for a wake through the same
   wake book the gateway's wake requests use (many requests, one wake), kicks a claim that waits
   for room or a start, and waits for the next status or route change. A held request counts
   against its model's bound (``max_held``; past it: 503 at once) and gives up after
   ``max_wait_s`` (503); both carry the guide's Retry-After for the state it waited in. A client
   that disconnects cancels its handler, which leaves the queue. A replica that stops serving
   (``standby``: a Kubernetes leader stepping down) answers its held requests 503;
3. the prompt and the output limit are checked against the engine's context window
   (``window``), before the request may wake or start its model where the count allows;
4. ``proxy.forward`` sends it to the engine the route names and the answer back.

From the moment a claim is picked until the answer is sent, the request counts in flight for the
claim's model (``Ledger``): the reconciler's idle check asks ``in_flight`` before every sleep,
and the idle tracker is told the model was busy when a request starts and ends.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from engine_http.calls import post_json
from engine_http.framing import UpstreamError
from engine_http.upstream import Upstream
from guard import jsonbody
from reconciler.context import Deps
from reconciler.desired import ClaimKey, key_text
from reconciler.door import endpoints, errors, ollama, plan, proxy, usage, window
from reconciler.door.access import AccessRecord
from reconciler.door.catalog import Catalog
from reconciler.door.forwards import Forwards, slots
from reconciler.door.http1 import Answer, Request, Stream
from reconciler.door.keys import Key
from reconciler.door.ledger import Changes, Ledger, Ticket
from reconciler.door.metrics import DoorMetrics
from reconciler.door.room import Room, room_for
from reconciler.door.routing import Rechoice, Routed, Router
from reconciler.door.settings import DoorSettings
from reconciler.replicas import base_key, replica_keys, route_name
from reconciler.routes import Route, route_of
from reconciler.selection.delay import Demand, bring_up, queue_wait
from reconciler.selection.route_spec import Route as ModelRoute
from reconciler.status import ACTIVE, SLEEPING, ClaimStatus

TOKENIZE_TIMEOUT_S = 5.0


class Refused(Exception):
    """A request answered by the door itself; ``reason`` feeds the errors metric."""

    def __init__(self, response: Answer, reason: str) -> None:
        super().__init__(reason)
        self.response = response
        self.reason = reason


def _rechosen(again: Rechoice, lost: bool) -> tuple[ClaimKey, ...]:
    """The claim a held route call goes to now (``()``: it keeps its own); ``Refused`` when
    its claim is lost and the route now refuses."""
    got = again.again(lost)
    if got is None:
        return ()
    if not isinstance(got, Routed):
        raise Refused(errors.route_refused(got), got.code)
    return (got.claim,)


class Door:
    """The front door's logic; ``reconciler.door.server`` serves it over HTTP."""

    def __init__(self, settings: DoorSettings, deps: Deps, metrics: DoorMetrics,
                 ledger: Ledger, changes: Changes,
                 standby: Callable[[], str | None] = lambda: None) -> None:
        self.settings = settings
        # why this replica cannot serve now (a Kubernetes standby has no claims, statuses or
        # routes: it must not answer from them); None while it can
        self.standby = standby
        self.w, self.b = deps.reader, deps.books
        self.metrics = metrics
        self.ledger = ledger
        self.changes = changes
        self.catalog = Catalog(self.w.desired, self.endpoint)
        # every request to engines: the proxied ones and the door's own asks (engine_http)
        self.upstream = Upstream(timeout=settings.upstream_timeout_s)
        self._urls: tuple[object, dict[str, str]] | None = None
        self._decided: dict[ClaimKey, tuple[int, plan.Forward]] = {}
        wakes, clock = self.b.wakes, self.w.clock
        self.forwards = Forwards()  # the door's own forwards per claim (the route's queue)
        self.router = Router(self.w.desired, lambda k: self.catalog.context(k, self.model_of(k)),
                             lambda: self.catalog.version,
                             lambda k: self.decide(self.replicas(k)),  # its best replica
                             lambda m: (w := wakes.get(m)) is not None
                             and not wakes.expired(w, clock.now()), clock.now, self.forwards,
                             self.dormant_room, settings.max_wait_s)

    # ---- the reconciler's view ------------------------------------------------------------

    def urls(self) -> dict[str, str]:
        pools = self.w.desired.pools
        if self._urls is None or self._urls[0] is not pools:
            self._urls = (pools, {a.name: a.url for a, _ in self.w.desired.agents()})
        return self._urls[1]

    def _healthy(self, agent: str) -> bool:
        obs = self.w.cache.last(agent)
        return obs is not None and obs.ok

    def status_and_route(self, key: ClaimKey) -> tuple[ClaimStatus | None, Route | None]:
        st = self.w.store.get(key)
        if st is None:
            return None, None
        return st, route_of(st, self.urls(), self._healthy, self.b.holds, self.b.wakes)

    def endpoint(self, key: ClaimKey) -> tuple[str, int] | None:
        """Where the claim's engine process listens, while it has one (awake or asleep)."""
        st, route = self.status_and_route(key)
        inst = st.instance if st is not None else None
        if st is None or route is None or inst is None or inst.port <= 0 \
                or st.phase not in (ACTIVE, SLEEPING) or not route.host:
            return None
        return route.host, inst.port

    def dormant_room(self, key: ClaimKey, model: str) -> Room | None:
        """A sleeping claim's GPU as the door sees it (``door.room``), for a route's choice:
        None unless its engine is on one GPU of an agent whose last snapshot answered and its
        figures are known."""
        st = self.w.store.get(key)
        inst = st.instance if st is not None else None
        if inst is None or not inst.agent or len(inst.devices) != 1:
            return None
        obs = self.w.cache.last(inst.agent)
        cand = self.w.planned_view(obs) if obs is not None and obs.ok else None
        per_gpu = self.w.per_gpu(base_key(key))
        if obs is None or cand is None or per_gpu is None:
            return None
        claims = {e.model_name: e.claim_ref for e in obs.engines if e.claim_ref is not None}
        now, ledger, agent = self.w.clock.now(), self.ledger, inst.agent

        def usage(name: str) -> tuple[int, Demand]:
            ref = claims.get(name)
            return ledger.in_flight(name), Demand(
                ledger.held(name), self.router.book.intents(key_text(ref)) if ref else 0,
                self.forwards.recent_use(ref, now) if ref else 0.0,
                last_used=self.b.tracker.last_busy(agent, name))

        return room_for(cand, inst.devices[0], model, per_gpu.room, now, usage,
                        lambda name: key_text(claims[name]) if name in claims else name)

    def queue_wait(self, key: ClaimKey) -> float | None:
        """Seconds until a new call to the claim could start on one of its serving replicas
        (the seed's queue wait over the door's forwards to each, its calls held for the model
        spread across them); None while none serves. What copies by demand weigh."""
        claim = self.catalog.claim(key)
        if claim is None:
            return None
        serving = [k for k in self.replicas(key) if isinstance(self.decide((k,)), plan.Forward)]
        if not serving:
            return None
        held = -(-self.ledger.held(claim.model_name) // len(serving))
        return min(self.engine_wait(k, held) for k in serving)

    def engine_wait(self, key: ClaimKey, held: int = 0) -> float:
        """Seconds until a new call could start at the claim's engine, from the door's forwards
        to it and ``held`` more calls waiting for it (``queue_wait``; what ``plan.choose``
        weighs against waking another copy)."""
        claim = self.catalog.claim(base_key(key))
        per = slots(claim.engine, claim.engine_args) if claim is not None else 1
        fw = self.forwards
        return queue_wait(fw.in_flight(key), held, per, fw.latency(key), self.w.clock.now())

    def wake_estimate(self, key: ClaimKey) -> float:
        """Seconds a sleeping copy of the claim takes to serve: its footprint at the seed's
        1 GiB/s, as the scaler prices a copy (a wake is faster, so this leans to queueing);
        infinite when the claim declared no footprint."""
        per_gpu = self.w.per_gpu(base_key(key))
        return bring_up(None, per_gpu.maximum_footprint) if per_gpu is not None else math.inf

    def replicas(self, key: ClaimKey) -> tuple[ClaimKey, ...]:
        """The claim's key and its replicas' (``reconciler.replicas``), replica 0 first."""
        claim = self.catalog.claim(key)
        return (key, *replica_keys(key, claim.replicas if claim is not None else 1))

    def model_of(self, key: ClaimKey) -> str:
        claim = self.w.desired.claim(key)
        return claim.model_name if claim is not None else key[1]

    def route_of(self, key: ClaimKey) -> str:
        """What the ledger counts the claim's requests in flight under: its replica's name
        (``reconciler.replicas``; the model name for replica 0)."""
        return route_name(self.model_of(key), key)

    def decide(self, keys: tuple[ClaimKey, ...]) -> plan.Decision:
        """``plan.decide`` for each claim and ``plan.choose`` among them. A lone claim that
        serves is remembered until the next status or route change (``Changes``): its agent's
        health, which changes without one, is looked at on every call."""
        if len(keys) == 1:
            known = self._decided.get(keys[0])
            if known is not None and known[0] == self.changes.version \
                    and self._healthy(known[1].agent):
                return known[1]
        decisions = [plan.decide(k, *self.status_and_route(k)) for k in keys]
        chosen = plan.choose(decisions, lambda k: self.ledger.in_flight(self.route_of(k)),
                             self.engine_wait, self.wake_estimate)
        if len(keys) == 1 and isinstance(chosen, plan.Forward):
            self._decided[keys[0]] = (self.changes.version, chosen)
        return chosen

    # ---- holding ----------------------------------------------------------------------------

    async def admit(self, name: str, keys: tuple[ClaimKey, ...], ticket: Ticket,
                    rec: AccessRecord, key: Key | None = None,
                    again: Rechoice | None = None) -> plan.Forward:
        """The claim to forward to, once it serves; ``Refused`` when it cannot in time, or
        when its claims were deleted meanwhile. ``again``: a routed call's second choice,
        asked after each wait (a candidate became warm) and when its claim is gone or
        refuses; ``again.routed`` is then what serves."""
        s = self.settings
        deadline = rec.started + s.max_wait_s
        held_since: float | None = None
        kicked: set[ClaimKey] = set()
        try:
            while True:
                changed = self.changes.next()  # before looking: a change after it wakes us
                why = self.standby()
                if why is not None:  # the replica stopped serving (it no longer leads)
                    raise Refused(errors.not_serving(why), "not_leading")
                keys = tuple(k for k in keys if self.w.desired.claim(k) is not None)
                if not keys and again is not None:  # the chosen claim was deleted
                    keys = _rechosen(again, True) or keys
                if not keys:
                    raise Refused(errors.unknown_model(name, self.visible_names(key)),
                                  "unknown_model")
                d = self.decide(keys)
                if again is not None and (isinstance(d, plan.Refuse) or held_since is not None
                                          and isinstance(d, plan.Hold)):
                    rechosen = _rechosen(again, isinstance(d, plan.Refuse))
                    if rechosen:
                        keys, d = rechosen, self.decide(rechosen)
                model, named = self.model_of(d.claim), self.route_of(d.claim)
                ticket.enter(named)  # no await since the decision: this replica's idle check
                # sees it
                rec.model, rec.claim = model, key_text(d.claim)
                if isinstance(d, plan.Forward):
                    if held_since is not None:
                        held = time.monotonic() - held_since
                        rec.held_ms = round(held * 1000, 3)
                        self.metrics.was_held(model, rec.held_for or plan.START, held)
                    return d
                if isinstance(d, plan.Refuse):
                    raise Refused(errors.unavailable(d.message, "model_unavailable",
                                                     d.retry_after), "unavailable")
                if not ticket.hold(model, s.max_held):
                    raise Refused(errors.unavailable(
                        f"{s.max_held} requests already wait for model {model!r} ({d.cause}); "
                        "try again later", "queue_full", d.retry_after), "queue_full")
                if held_since is None:
                    held_since = time.monotonic()
                if rec.held_for in (None, plan.SETTLE):
                    rec.held_for = d.cause
                if d.wake:  # a route's made-room choice names whom to sleep for it
                    victims = again.routed.victims if again is not None \
                        and base_key(d.claim) == again.routed.claim else ()
                    _, new = self.b.ask_wake(named, d.claim, victims)
                    if new:
                        self.metrics.wake_requested(model)
                if d.kick and d.claim not in kicked:
                    kicked.add(d.claim)
                    self.b.kick_claim(d.claim)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Refused(errors.unavailable(
                        f"model {model!r} did not become ready within {s.max_wait_s:g} s "
                        f"(waiting for: {d.cause}); try again later", "wait_timeout",
                        d.retry_after), "wait_timeout")
                try:  # not wait_for: on 3.11 it swallows a cancel that comes with a change
                    async with asyncio.timeout(min(left, s.recheck_s)):
                        await changed.wait()
                except TimeoutError:
                    pass
        finally:
            ticket.unhold()

    # ---- one request --------------------------------------------------------------------------

    async def serve(self, request: Request, endpoint: str, doc: Mapping[str, Any],
                    body: bytes, key: Key | None, ticket: Ticket,
                    rec: AccessRecord, outcome: proxy.Outcome,
                    routed: Routed | None = None) -> Answer | Stream:
        """One request; ``routed``: the claim a route chose for it (``serve_route``)."""
        if routed is None:  # the exact name's path: as before, one test more
            name = doc["model"]
            keys = self.catalog.claims_for(name)
            if not keys:  # a route's name, or perhaps an adapter loaded since we last asked
                route = self.w.desired.routes.get(name)
                if route is not None:
                    return await self.serve_route(route, request, endpoint, doc, body, key,
                                                  ticket, rec, outcome)
                await self.refresh_names()
                keys = self.catalog.claims_for(name)
            if not keys:
                raise Refused(errors.unknown_model(name, self.visible_names(key)),
                              "unknown_model")
            if key is not None and not self.allowed(key, name, keys):
                raise Refused(errors.not_allowed(name, self.visible_names(key)), "forbidden")
        else:
            name, keys = routed.model, self.replicas(routed.claim)  # fewest in flight
        kinds = endpoints.engines_for(request.path)
        first = self.catalog.claim(keys[0])
        if first is not None and first.engine not in kinds:  # before any wake is asked
            raise Refused(errors.bad_request(
                f"{request.path} is served by {endpoints.kinds_text(kinds)} engines; model "
                f"{name!r} runs on {endpoints.kinds_text(frozenset((first.engine,)))}.",
                "model"), "wrong_engine")
        again = None if routed is None else self._rechoice(routed, endpoint, doc, body, kinds)
        try:
            checked = len(keys) == 1 and await self.check_context(  # before it may wake
                endpoint, doc, body, keys[0], name, lambda: self.endpoint(keys[0]))
            fwd = await self.admit(name, keys, ticket, rec, key, again)
        finally:  # admitted (its model serves: the snapshot holds its load) or refused
            if again is not None:
                self.router.release(again.routed.plan_id)
        claim = self.catalog.claim(fwd.claim)
        assert claim is not None  # admit looked, with no await since
        model = claim.model_name
        if again is not None:  # what serves it, the first choice or a second one
            routed = again.routed
            if fwd.claim != keys[0]:
                name, checked = routed.model, False
            rec.route_choice = routed.kind
            rec.route_slept = ",".join(routed.victims) or None
            if routed.rechosen_from is not None:
                rec.route_rechosen_from = key_text(routed.rechosen_from)
            self.metrics.route_chose(routed.route, routed.kind, routed.model)
        rec.upstream = f"{fwd.agent} {fwd.host}:{fwd.port}"
        self.catalog.learn_soon(self.upstream, fwd.claim, fwd.host, fwd.port)
        upstream_name = self.catalog.upstream_name(claim, name)
        if not checked:
            await self.check_context(endpoint, doc, body, fwd.claim, name,
                                     lambda: (fwd.host, fwd.port))
        if endpoint in endpoints.OLLAMA_NATIVE:  # the pool keeps it loaded, not the client
            body, hide_usage = ollama.native_body(doc, body, upstream_name), False
        else:  # the engine's own token counts for every stream, asked for the client if need be
            body, hide_usage = usage.upstream_body(endpoint, doc, body, upstream_name)
        tried: set[ClaimKey] = set()
        while True:
            forwards, started = self.forwards, self.w.clock.now()
            self.b.tracker.busy(fwd.agent, model, started)
            forwards.start(fwd.claim, started)  # no await since admit: the next choice sees it
            extra = routed.headers(fwd.agent) if routed is not None else None
            answered = False
            try:
                answer = await proxy.forward(request, self.upstream, fwd.host, fwd.port,
                                             request.path, body, outcome, hide_usage, extra)
                answered = outcome.error is None
            finally:
                ended = self.w.clock.now()
                forwards.end(fwd.claim, started, ended, answered)
                self.b.tracker.busy(fwd.agent, model, ended)
                if self.ledger.any_held():  # a slot came free: a held route call may take it
                    self.changes.bump()  # now, not at its next look (recheck_s)
            tried.add(fwd.claim)
            other = plan.another(keys, fwd.claim, tried, self.decide) if outcome.unreached \
                else None
            if other is None:
                return answer
            # the engine was never reached (its port refused: it died, say): another replica
            # of the same claim that serves takes the request, the engine's status not yet
            # caught up
            self.metrics.failed(model, "replica_unreachable")
            outcome.status, outcome.error, outcome.unreached = 0, None, False
            fwd = other
            ticket.enter(self.route_of(fwd.claim))  # no await since the decision
            rec.claim, rec.upstream = key_text(fwd.claim), f"{fwd.agent} {fwd.host}:{fwd.port}"

    async def serve_route(self, route: ModelRoute, request: Request, endpoint: str,
                          doc: Mapping[str, Any], body: bytes, key: Key | None, ticket: Ticket,
                          rec: AccessRecord, outcome: proxy.Outcome) -> Answer | Stream:
        """A request to a ModelRoute: the per-call choice (``routing``), then the chosen
        claim's own path (held, woken, checked, forwarded), its answer attributed."""
        if key is not None and not key.may_use(route.name):
            raise Refused(errors.not_allowed(route.name, self.visible_names(key)), "forbidden")
        rec.route = route.name
        got = self.router.choose(route, endpoint, doc, body)
        if not isinstance(got, Routed):
            raise Refused(errors.route_refused(got), got.code)
        rec.route_choice = got.kind  # counted once forwarded (``serve``): it may be replaced
        try:
            return await self.serve(request, endpoint, doc, body, key, ticket, rec, outcome,
                                    got)
        finally:  # ``serve`` releases it once admitted; here too when refused before
            self.router.release(got.plan_id)

    def _rechoice(self, routed: Routed, endpoint: str, doc: Mapping[str, Any], body: bytes,
                  kinds: frozenset[str]) -> Rechoice | None:
        """A routed call's way to a second choice while held, among the candidates whose
        engine serves this endpoint (None: its route is gone)."""
        route = self.w.desired.routes.get(routed.route)
        if route is None:
            return None
        return Rechoice(self.router, route, endpoint, doc, body, routed,
                        lambda k: (c := self.catalog.claim(k)) is not None and c.engine in kinds)

    async def check_context(self, endpoint: str, doc: Mapping[str, Any], body: bytes,
                            key: ClaimKey, name: str,
                            where: Callable[[], tuple[str, int] | None]) -> bool:
        """Refuse a request the claim's engine cannot hold (``window``): an output limit over
        the whole context, or a prompt over it. ``where``: the engine's address, awake or asleep
        (None: no engine runs), asked only when a count needs the engine (a route lookup per
        request would cost every small one). True when checked; False when the context or the prompt's count
        needs an engine that does not run yet (the caller checks again once one serves)."""
        claim = self.catalog.claim(key)
        context = self.catalog.context(key, name)
        if claim is None or context is None:
            return False  # learned from the engine once it serves, perhaps
        asked = window.output_limit(endpoint, doc) if claim.engine == "vllm" else None
        if asked is not None and asked[1] > context:
            raise Refused(errors.context_exceeded(window.output_refusal(context, asked[1]),
                                                  asked[0]), "context_length_exceeded")
        if endpoint not in window.COUNTED or not window.needs_count(len(body), context):
            return True
        prompt = window.prompt_of(endpoint, doc, self.catalog.upstream_name(claim, name))
        if prompt is None:
            return True
        count: int | None = prompt.token_ids
        if count is None and claim.engine == "ollama":
            count = window.estimate(prompt.text)
        elif count is None and claim.engine == "vllm" and prompt.tokenize_body is not None:
            address = where()
            if address is None:
                return False
            count = await self._tokenize(address, prompt.tokenize_body)
        if window.exceeded(count, context):
            assert count is not None
            raise Refused(errors.context_exceeded(
                window.refusal_message(count, context, prompt.param), prompt.param),
                "context_length_exceeded")
        return True

    async def _tokenize(self, where: tuple[str, int], body: dict[str, Any]) -> int | None:
        """The engine's own count (vLLM's ``/tokenize``, answered asleep too); None when it gave
        none."""
        try:  # counting twice is harmless: a pooled connection may be retried
            reply = await post_json(self.upstream, *where, "/tokenize", body, TOKENIZE_TIMEOUT_S,
                                    fresh=False)
            if reply.status != 200:
                return None
            doc = jsonbody.loads(reply.body)  # an engine's nesting bounded too
        except (UpstreamError, ValueError):
            return None
        count = doc.get("count") if isinstance(doc, dict) else None
        return count if isinstance(count, int) else None

    # ---- keys -------------------------------------------------------------------------------

    def allowed(self, key: Key, name: str, keys: tuple[ClaimKey, ...]) -> bool:
        return key.may_use(name) or any(key.may_use(self.model_of(k)) for k in keys)

    def visible_names(self, key: Key | None) -> list[str]:
        names = self.catalog.names()
        routes = sorted(self.w.desired.routes)
        if key is None:
            return names + routes
        return [n for n in names if self.allowed(key, n, self.catalog.claims_for(n))] \
            + [n for n in routes if key.may_use(n)]

    # ---- the models list ----------------------------------------------------------------------

    async def refresh_names(self) -> None:
        """Ask the engines what they serve now (at most once a second)."""
        await self.catalog.refresh(self.upstream, list(self.w.desired.claims))

    def listing(self, key: Key | None) -> list[dict[str, Any]]:
        """``/v1/models``: every claim's model and its adapters, with context length and the
        route's state, then every ModelRoute with its candidates, as far as ``key`` may use
        them."""
        out: list[dict[str, Any]] = []
        for ckey, claim in sorted(self.w.desired.claims.items()):
            st, route = self.status_and_route(ckey)
            common = {"object": "model", "created": int(st.created if st else time.time()),
                      "owned_by": "warm-pool", "state": route.state if route else "activating"}
            names: list[tuple[str, str, str | None]] = [(claim.model_name, claim.artifact_url,
                                                          None)]
            names += [(a, a, claim.model_name) for a in self.catalog.adapters(ckey)]
            for name, root, parent in names:
                if key is not None and not self.allowed(key, name, (ckey,)):
                    continue
                out.append({"id": name, **common, "root": root, "parent": parent,
                            "max_model_len": self.catalog.context(ckey, name)})
        return out + self.router.listing(lambda n: key is None or key.may_use(n))

    def ollama_claims(self, key: Key | None) -> list[tuple[ClaimKey, str, float, str,
                                                         tuple[str, int] | None]]:
        """Each Ollama claim ``key`` may use: (claim, artifact, created, route state, where its
        engine listens), for ``/api/tags`` and ``/api/ps`` (``reconciler.door.ollama``)."""
        out = []
        for ckey, claim in sorted(self.w.desired.claims.items()):
            if claim.engine != "ollama" or key is not None and not self.allowed(
                    key, claim.model_name, (ckey,)):
                continue
            st, route = self.status_and_route(ckey)
            out.append((ckey, claim.artifact_url, st.created if st else time.time(),
                        route.state if route else "activating", self.endpoint(ckey)))
        return out
