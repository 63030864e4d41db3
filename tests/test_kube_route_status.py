"""ModelRoutes on Kubernetes, the parts without an API server: route objects taken by the
directory's rule, the status each gets, and the Events a change raises."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from reconciler.kube.desired import KubeDesired
from reconciler.kube.route_objects import RouteObjects
from reconciler.kube.route_status import route_status, warnings
from reconciler.model.manifests import Problem
from tests.test_reconciler_kube import claim_obj
from tests.test_reconciler_kube_routes import route_obj

pytestmark = pytest.mark.timeout(30)
MATCHED = {"candidates": [{"claim": "default/a", "model": "a-model", "score": 60.0}],
           "conditions": [{"type": "FailedScheduling", "status": "False", "reason": "Matched",
                           "message": "1 candidate(s) match {family=qwen}"}]}
NONE = {"candidates": [], "conditions": [{"type": "FailedScheduling", "status": "True",
                                          "reason": "NoMatchingModel",
                                          "message": "no claim matches {family=llama}"}]}


def versioned(obj: dict[str, Any], version: str, **status: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["resourceVersion"] = version
    if status:
        out["status"] = status
    return out


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_a_condition_keeps_its_transition_time_while_its_status_stays() -> None:
    first = route_status(MATCHED, None, 1, None, 1000.0)
    again = route_status(MATCHED, None, 1, first, 2000.0)
    assert again == first  # nothing to write
    failing = route_status(NONE, None, 2, again, 3000.0)
    assert cond(failing, "FailedScheduling")["lastTransitionTime"] == "1970-01-01T00:50:00Z"
    assert cond(failing, "Accepted")["lastTransitionTime"] == "1970-01-01T00:16:40Z"
    assert (failing["candidateCount"], "preferred" in failing) == (0, False)
    assert failing["observedGeneration"] == cond(failing, "Accepted")["observedGeneration"] == 2


def test_an_event_is_raised_when_a_route_turns_to_failing_and_not_while_it_stays() -> None:
    matched = route_status(MATCHED, None, 1, None, 0.0)
    failing = route_status(NONE, None, 1, matched, 1.0)
    assert warnings(matched, failing) == [("FailedScheduling", "no claim matches {family=llama}")]
    assert warnings(failing, route_status(NONE, None, 1, failing, 2.0)) == []
    assert warnings(None, matched) == []


def test_a_refused_route_says_why_once_and_again_when_the_reason_changes() -> None:
    bad = Problem("ModelRoute", "r", "InvalidRoute", "spec.tolerance must be ...", "default")
    refused = route_status(None, bad, 1, None, 0.0)
    assert cond(refused, "Accepted")["status"] == "False" and refused["candidates"] == []
    assert warnings(None, refused) == [("InvalidRoute", "spec.tolerance must be ...")]
    assert warnings(refused, route_status(None, bad, 1, refused, 1.0)) == []
    clash = Problem("ModelRoute", "r", "Duplicate", "'r' is the modelName of ...", "default")
    assert warnings(refused, route_status(None, clash, 1, refused, 1.0)) == [
        ("Duplicate", "'r' is the modelName of ...")]


def test_our_own_status_write_takes_nothing_again_and_a_spec_change_does() -> None:
    objects = RouteObjects()
    obj = versioned(route_obj("chat"), "1")
    assert objects.change(None, obj)
    written = versioned(obj, "2", candidates=[])
    assert not objects.change(obj, written)
    assert objects.get(("default", "chat")) == written  # the newest kept all the same
    edited = versioned(written, "3")
    edited["spec"]["tolerance"] = 0
    assert objects.change(written, edited)
    assert objects.change(edited, None) and objects.names == frozenset()


def test_a_route_name_in_two_namespaces_is_served_from_the_first() -> None:
    objects = RouteObjects()
    for ns in ("team-b", "team-a"):
        obj = route_obj("chat")
        obj["metadata"]["namespace"] = ns
        objects.change(None, obj)
    routes, problems = objects.take({})
    assert routes["chat"].namespace == "team-a"
    assert [(p.namespace, p.reason) for p in problems] == [("team-b", "Duplicate")]


async def test_a_claim_that_takes_a_routes_name_refuses_the_route_at_the_next_turn() -> None:
    desired = KubeDesired()
    taken: list[int] = []
    desired.on_routes_changed(lambda: taken.append(len(desired.routes)))
    desired.on_route(None, route_obj("x-model"))
    desired.flush()
    assert list(desired.routes) == ["x-model"] and taken == [1]
    desired.on_claim(None, claim_obj("x"))  # its modelName is x-model
    await asyncio.sleep(0)
    assert desired.routes == {} and taken == [1, 0]
    assert [(p.name, p.reason) for p in desired.route_problems] == [("x-model", "Duplicate")]
    assert desired.by_model("x-model") == ("default", "x")
