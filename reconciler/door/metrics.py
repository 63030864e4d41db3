"""The door's Prometheus metrics, per model, in the reconciler's registry (its ``/metrics``).

| metric | labels | what |
|---|---|---|
| ``aibrix:door_requests_total`` | model, endpoint, code | answered requests by HTTP status |
| ``aibrix:door_request_errors_total`` | model, reason | why a request failed (``queue_full``, ``wait_timeout``, ``context_length_exceeded``, ``upstream_error``, ``upstream_broken``, ``upstream_timeout``, ``client_disconnected``, ...) |
| ``aibrix:door_request_duration_seconds`` | model, endpoint | arrival to the last byte |
| ``aibrix:door_time_to_first_token_seconds`` | model | arrival to the first byte of a stream |
| ``aibrix:door_held_seconds`` | model, cause | time held before forwarding: ``wake``, ``room``, ``start``, ``move``, ``settle`` |
| ``aibrix:door_wakes_requested_total`` | model | wakes the door asked the reconciler for (repeats collapse) |
| ``aibrix:door_tokens_total`` | model, kind | ``prompt`` and ``completion`` tokens from the engines' ``usage`` (streams too: ``reconciler.door.usage``) |
| ``aibrix:door_route_choices_total`` | route, kind, model | calls to a ModelRoute by what served them (``warm``, ``converged``, ``woken``, ``started``, ``queued``, ``made-room``, ``held``) and the claim model that served (counted when forwarded; a second choice by its own kind) |
| ``aibrix:door_requests_in_flight``, ``aibrix:door_requests_held`` | model | now |

``model`` is the claim's modelName (an adapter counts under its claim), or ``""`` for a request
that named no model the door knows, so unknown names cannot grow the series without bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from reconciler.door.ledger import Ledger
from reconciler.replicas import model_of_route

P = "aibrix:door_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)


class _Now(Collector):
    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def collect(self) -> Iterable[GaugeMetricFamily]:
        flight = GaugeMetricFamily(P + "requests_in_flight",
                                   "Requests the door holds or forwards now.", labels=["model"])
        held = GaugeMetricFamily(P + "requests_held",
                                 "Requests the door holds for a wake, room or a start.",
                                 labels=["model"])
        flights: dict[str, int] = {}
        for name in self._ledger.models():  # a replica's requests count for its model
            model = model_of_route(name)
            flights[model] = flights.get(model, 0) + self._ledger.in_flight(name)
        for model in sorted(flights):
            flight.add_metric([model], flights[model])
            held.add_metric([model], self._ledger.held(model))
        yield flight
        yield held


class DoorMetrics:
    def __init__(self, registry: CollectorRegistry, ledger: Ledger) -> None:
        self.requests = Counter(P + "requests", "Requests answered by the door.",
                                ["model", "endpoint", "code"], registry=registry)
        self.errors = Counter(P + "request_errors", "Requests that failed, by reason.",
                              ["model", "reason"], registry=registry)
        self.duration = Histogram(P + "request_duration_seconds",
                                  "Request arrival to its last byte.", ["model", "endpoint"],
                                  buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram(P + "time_to_first_token_seconds",
                              "Request arrival to the first byte of a streamed answer.",
                              ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.held = Histogram(P + "held_seconds", "Time a request was held before forwarding.",
                              ["model", "cause"], buckets=LATENCY_BUCKETS, registry=registry)
        self.wakes = Counter(P + "wakes_requested", "Wakes the door asked for.", ["model"],
                             registry=registry)
        self.tokens = Counter(P + "tokens", "Tokens the engines reported in usage.",
                              ["model", "kind"], registry=registry)
        self.route_choices = Counter(P + "route_choices", "Calls to a ModelRoute by choice.",
                                     ["route", "kind", "model"], registry=registry)
        registry.register(_Now(ledger))
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def answered(self, model: str, endpoint: str, code: int, seconds: float) -> None:
        self._child(self.requests, model, endpoint, str(code)).inc()
        self._child(self.duration, model, endpoint).observe(seconds)

    def failed(self, model: str, reason: str) -> None:
        self._child(self.errors, model, reason).inc()

    def first_token(self, model: str, seconds: float) -> None:
        self._child(self.ttft, model).observe(seconds)

    def was_held(self, model: str, cause: str, seconds: float) -> None:
        self._child(self.held, model, cause).observe(seconds)

    def wake_requested(self, model: str) -> None:
        self._child(self.wakes, model).inc()

    def route_chose(self, route: str, kind: str, model: str) -> None:
        self._child(self.route_choices, route, kind, model).inc()

    def usage(self, model: str, prompt: int, completion: int) -> None:
        if prompt:
            self._child(self.tokens, model, "prompt").inc(prompt)
        if completion:
            self._child(self.tokens, model, "completion").inc(completion)
