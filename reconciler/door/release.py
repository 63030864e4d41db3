"""``POST /v1/models/{model}/release``: a person at the door lets a model go now.

llama-swap's ``/unload`` for this pool: off unless the door runs with ``--door-allow-release``
(then 404, as for any route the door does not serve), and, with API keys, only for a key that
may use the model. The door never calls an agent's lifecycle API: it records a release in the
reconciler's ``ReleaseBook`` (``Books.ask_release``, as a request for a sleeping model records a
wake) and waits for the claim to be Sleeping; the claim reconciler puts it to sleep by the idle
path (off the route, the last look for requests in the engine and in flight here, the sleep).
The pool's rules hold, each refusal a 409 that says why:

* only vLLM engines sleep in this pool (an Ollama or SGLang claim stays loaded);
* only an Active claim can be released (a starting, moving or failed one cannot);
* a model that requests wait for (held here, or a wake asked) is not released under them;
* a model still busy when the release expires (``RELEASE_TTL_S``) is left awake, and a sleep the
  agent refused is answered with the agent's message.

A claim with several replicas (``reconciler.replicas``) is released whole: each replica that
serves is asked to sleep (a release is kept per replica's route name, as a wake is), and the
answer comes once none of them serves. A model asleep already (no replica serves, one sleeps)
answers 200 at once. The answer: ``{"model", "claim", "state":
"sleeping", "released": true|false, "seconds"}``.
"""

from __future__ import annotations

import asyncio
import time

from reconciler.desired import key_text
from reconciler.door import errors
from reconciler.door.door import Door
from reconciler.door.http1 import Answer, json_answer
from reconciler.door.keys import Key
from reconciler.replicas import base_key, route_name, summary_phase
from reconciler.status import ACTIVE, SLEEPING

SUFFIX = "/release"


def conflict(message: str) -> Answer:
    return errors.error_response(409, message, "invalid_request_error", "release_refused",
                                 "model")


async def release(door: Door, name: str, key: Key | None) -> Answer:
    if not door.settings.allow_release:
        return errors.error_response(404, "The release route is off on this door (start it "
                                     "with --door-allow-release).", "invalid_request_error",
                                     "unknown_url")
    keys = door.catalog.claims_for(name)
    if not keys:
        return errors.unknown_model(name, door.visible_names(key))
    if key is not None and not door.allowed(key, name, keys):
        return errors.not_allowed(name, door.visible_names(key))
    claims = list(dict.fromkeys(base_key(k) for k in keys))  # a claim and its replicas
    if len(claims) != 1:
        return conflict(f"`{name}` is served by {len(claims)} claims; release one by its "
                        "model name.")
    ckey = claims[0]
    claim = door.catalog.claim(ckey)
    members = [(k, st) for k in keys if (st := door.w.store.get(k)) is not None]
    if claim is None or not members:
        return errors.unknown_model(name, door.visible_names(key))
    model = claim.model_name
    answer = {"model": model, "claim": key_text(ckey), "state": "sleeping"}
    serving = [k for k, st in members if st.phase == ACTIVE]  # each is released
    if not serving and any(st.phase == SLEEPING for _, st in members):
        return json_answer({**answer, "released": False, "seconds": 0.0})
    if claim.engine != "vllm":
        return conflict(f"Only vLLM engines sleep in this pool; `{model}` runs on "
                        f"{claim.engine} and stays loaded until its claim is deleted.")
    if not serving:
        phase = summary_phase([st.phase for _, st in members])
        return conflict(f"`{model}` is {phase}; only an Active model can be released.")
    named = {k: route_name(model, k) for k, _ in members}
    waiting = door.ledger.held(model)  # held per model, whichever replica it waits for
    if waiting or any(door.b.wakes.get(n) is not None for n in named.values()):
        return conflict(f"{waiting} requests wait for `{model}` (a wake is asked); it is not "
                        "released under them.")
    started = time.monotonic()
    reqs = {k: door.b.ask_release(named[k], k) for k in serving}  # per replica (lifecycle)
    deadline = started + door.b.releases.ttl
    while True:
        changed = door.changes.next()
        if door.w.store.get(ckey) is None:
            return errors.unknown_model(name, door.visible_names(key))
        left_awake = [k for k in reqs if (st := door.w.store.get(k)) is not None
                      and st.phase != SLEEPING]  # a replica drained meanwhile is let go
        if not left_awake:
            return json_answer({**answer, "released": True,
                                "seconds": round(time.monotonic() - started, 3)})
        failed = next((r.error for r in reqs.values() if r.error is not None), None)
        if failed is not None:
            return conflict(f"`{model}` was not released: {failed}.")
        left = deadline - time.monotonic()
        if left <= 0 or any(door.b.releases.get(named[k]) is not reqs[k] for k in left_awake):
            for k in reqs:
                door.b.releases.drop(named[k])
            busy = sum(door.ledger.in_flight(named[k]) for k in left_awake)
            return conflict(f"`{model}` stayed busy for {door.b.releases.ttl:g} s ({busy} "
                            "requests in flight here) and was left awake; try again.")
        try:
            async with asyncio.timeout(min(left, door.settings.recheck_s)):
                await changed.wait()
        except TimeoutError:
            pass


__all__ = ["SUFFIX", "release"]
