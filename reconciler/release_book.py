"""Release requests: "let this model go now", asked by a person at the front door.

``POST /v1/models/{model}/release`` (off unless the door is started with
``--door-allow-release``) records a request here and kicks the claim; the claim's next idle look
(``Lifecycle.idle_check``) then treats the model as idle past ``sleepAfterSeconds`` and puts it
to sleep by the same path and the same last look as an idle sleep: off the route first, no
request running or waiting in the engine, none in flight through the door. A request lives
``ttl`` seconds (the door waits that long for the sleep): one the model never became idle for
is forgotten, so a release cannot put a model to sleep minutes after the person gave up. A sleep
the agent refused is kept with its message, for the door to answer. Requests are kept by a
replica's route name (``reconciler.replicas.route_name``: the model name for replica 0), so a
claim's replicas are released each, and the first to sleep does not drop the others' request.
"""

from __future__ import annotations

from dataclasses import dataclass

RELEASE_TTL_S = 30.0


@dataclass
class ReleaseRequest:
    model: str
    at: float  # the reconciler's clock
    error: str | None = None  # the agent's answer to a sleep that failed


class ReleaseBook:
    def __init__(self, ttl: float = RELEASE_TTL_S) -> None:
        self.ttl = ttl
        self._by_model: dict[str, ReleaseRequest] = {}

    def ask(self, model: str, now: float) -> ReleaseRequest:
        req = self._by_model.get(model)
        if req is None or now - req.at >= self.ttl or req.error is not None:
            req = self._by_model[model] = ReleaseRequest(model, now)
        return req

    def pending(self, model: str, now: float) -> bool:
        """A live request, not failed, for ``model``."""
        req = self._by_model.get(model)
        if req is not None and now - req.at >= self.ttl:
            del self._by_model[model]
            return False
        return req is not None and req.error is None

    def failed(self, model: str, message: str) -> None:
        req = self._by_model.get(model)
        if req is not None:
            req.error = message

    def get(self, model: str) -> ReleaseRequest | None:
        return self._by_model.get(model)

    def drop(self, model: str) -> None:
        self._by_model.pop(model, None)
