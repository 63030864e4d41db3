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

A model asleep already answers 200 at once. The answer: ``{"model", "claim", "state":
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
    if len(keys) != 1:
        return conflict(f"`{name}` is served by {len(keys)} claims; release one by its model "
                        "name.")
    ckey = keys[0]
    claim = door.catalog.claim(ckey)
    st = door.w.store.get(ckey)
    if claim is None or st is None:
        return errors.unknown_model(name, door.visible_names(key))
    model = claim.model_name
    answer = {"model": model, "claim": key_text(ckey), "state": "sleeping"}
    if st.phase == SLEEPING:
        return json_answer({**answer, "released": False, "seconds": 0.0})
    if claim.engine != "vllm":
        return conflict(f"Only vLLM engines sleep in this pool; `{model}` runs on "
                        f"{claim.engine} and stays loaded until its claim is deleted.")
    if st.phase != ACTIVE:
        return conflict(f"`{model}` is {st.phase}; only an Active model can be released.")
    waiting = door.ledger.held(model)
    if waiting or door.b.wakes.get(model) is not None:
        return conflict(f"{waiting} requests wait for `{model}` (a wake is asked); it is not "
                        "released under them.")
    started = time.monotonic()
    req = door.b.ask_release(model, ckey)
    deadline = started + door.b.releases.ttl
    while True:
        changed = door.changes.next()
        st = door.w.store.get(ckey)
        if st is None:
            return errors.unknown_model(name, door.visible_names(key))
        if st.phase == SLEEPING:
            return json_answer({**answer, "released": True,
                                "seconds": round(time.monotonic() - started, 3)})
        if req.error is not None:
            return conflict(f"`{model}` was not released: {req.error}.")
        left = deadline - time.monotonic()
        if left <= 0 or door.b.releases.get(model) is not req:
            door.b.releases.drop(model)
            busy = door.ledger.in_flight(model)
            return conflict(f"`{model}` stayed busy for {door.b.releases.ttl:g} s ({busy} "
                            "requests in flight here) and was left awake; try again.")
        try:
            async with asyncio.timeout(min(left, door.settings.recheck_s)):
                await changed.wait()
        except TimeoutError:
            pass


__all__ = ["SUFFIX", "release"]
