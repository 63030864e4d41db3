"""ModelRoute through the front door, end to end (issue 24): a real agent with simulated
engines, the reconciler and its door in this process (``tests.test_door_integration``'s
``Door``), clients over real sockets. A route's name is what clients send as ``model``; the
door chooses per call among the claims its ``require`` admits."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from reconciler.door.forwards import Forwards
from tests.test_door_integration import CHAT, SLEEPY, Door, claim, door, metric

__all__ = ["door"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
NEVER_SLEEP = "claim.model.aibrix.ai/lifecycle: '{\"neverSleep\": true}'"


def labelled(name: str, labels: dict[str, str], never_sleep: bool = False,
             args: dict[str, str] | None = None) -> str:
    """A claim whose ``metadata.labels`` say what its model is."""
    text = claim(name, **(args or {}))
    shown = ", ".join(f'{k}: "{v}"' for k, v in labels.items())
    meta = f"  namespace: default\n  labels: {{{shown}}}\n"
    if never_sleep:
        meta += f"  annotations:\n    {NEVER_SLEEP}\n"
    return text.replace("  namespace: default\n", meta, 1)


def route(name: str, tolerance: float = 10, family: str = "qwen") -> str:
    """A route over the ``family`` claims that prefers the big tier (60) over the small (55)."""
    return f"""apiVersion: model.aibrix.ai/v1alpha1
kind: ModelRoute
metadata: {{name: {name}}}
spec:
  require: {{matchLabels: {{family: {family}}}}}
  prefer:
    - {{weight: 60, selector: {{matchLabels: {{tier: big}}}}}}
    - {{weight: 55, selector: {{matchLabels: {{tier: small}}}}}}
  tolerance: {tolerance}
"""


async def two_models(door: Door, small_stays_awake: bool, **args: str) -> None:
    """Claims ``big`` (preferred) and ``small`` of one family, ``big`` asleep; ``small`` awake
    when ``small_stays_awake``, else asleep too."""
    door.write("big", labelled("big", {"family": "qwen", "tier": "big"}, args=args))
    door.write("small", labelled("small", {"family": "qwen", "tier": "small"},
                                 never_sleep=small_stays_awake, args=args))
    await door.phase("big", "Sleeping", 60)  # placed, awake, then a second idle
    await door.phase("small", "Active" if small_stays_awake else "Sleeping", 60)


async def get(door: Door, url: str) -> Any:
    assert door.http is not None
    async with door.http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_a_route_is_served_by_a_warm_candidate_while_the_preferred_one_sleeps(
        door: Door) -> None:
    door.pool(SLEEPY)
    await door.start()
    door.write("chat", route("chat", tolerance=10))
    await two_models(door, small_stays_awake=True)
    status, body, headers = await door.chat("chat")
    assert status == 200, body
    assert body["model"] == "small"  # the engine's name for it: the door renamed the request
    assert (headers["x-route"], headers["x-route-claim"], headers["x-route-model"],
            headers["x-route-agent"], headers["x-route-choice"]) == (
        "chat", "default/small", "small", "agent-a", "warm")
    assert door.wakes("big") == 0
    assert door.status("big").phase == "Sleeping"  # type: ignore[union-attr]
    line = await door.logged(1)
    assert (line["route"], line["route_choice"], line["model"], line["claim"]) == (
        "chat", "warm", "small", "default/small")
    text = await door.metrics()
    assert metric(text, "aibrix:door_route_choices_total", route="chat", kind="warm",
                  model="small") == 1.0
    listed = {m["id"]: m for m in (await get(door, door.url + "/v1/models"))["data"]}
    assert [(c["model"], c["score"]) for c in listed["chat"]["candidates"]] == [
        ("big", 60.0), ("small", 55.0)]
    assert {"big", "small"} <= listed.keys()


async def test_with_tolerance_zero_the_preferred_model_is_woken(door: Door) -> None:
    door.pool(SLEEPY)
    await door.start()
    door.write("strict", route("strict", tolerance=0))
    await two_models(door, small_stays_awake=True, **{"--sim-wake-seconds": "0.3"})
    status, body, headers = await door.chat("strict")
    assert status == 200, body
    assert body["model"] == "big"
    assert (headers["x-route-model"], headers["x-route-choice"]) == ("big", "woken")
    assert door.wakes("big") == 1
    line = await door.logged(1)
    assert (line["route_choice"], line["held_for"]) == ("woken", "wake")


async def test_a_burst_on_a_route_whose_candidates_all_sleep_makes_exactly_one_wake(
        door: Door) -> None:
    door.pool(SLEEPY)
    await door.start()
    door.write("chat", route("chat", tolerance=10))
    await two_models(door, small_stays_awake=False, **{"--sim-wake-seconds": "1"})
    answers = await asyncio.gather(*(door.chat("chat", user=str(i)) for i in range(20)))
    assert [status for status, _, _ in answers] == [200] * 20, answers
    assert door.wakes("big") + door.wakes("small") == 1
    assert {h["x-route-model"] for _, _, h in answers} == {"big"}
    kinds = [h["x-route-choice"] for _, _, h in answers]
    assert kinds.count("woken") >= 1 and set(kinds) <= {"woken", "converged"}, kinds
    text = await door.metrics()
    counted = sum(metric(text, "aibrix:door_route_choices_total", route="chat", kind=k,
                         model="big") or 0.0 for k in ("woken", "converged"))
    assert counted == 20.0


async def test_a_route_that_matches_no_claim_is_refused_at_once_with_the_condition_set(
        door: Door) -> None:
    door.pool()
    await door.start()
    door.write("m", labelled("m", {"family": "qwen"}))
    door.write("nothing", route("nothing", family="llama"))
    await door.phase("m", "Active")
    started = time.monotonic()
    status, body, headers = await door.chat("nothing")
    assert time.monotonic() - started < 1.0
    assert status == 503, body
    assert body["error"]["code"] == "no_matching_model"
    assert "family=llama" in body["error"]["message"] and "nothing" in body["error"]["message"]
    assert "Retry-After" not in headers
    assert door.engine("m")["request_success_total"] in (0, 0.0, None)  # never reached
    assert door.app is not None
    items = (await get(door, f"http://127.0.0.1:{door.app.port}/v1/modelroutes"))["items"]
    found = {i["name"]: i for i in items}["nothing"]
    assert found["candidates"] == []
    cond = found["conditions"][0]
    assert (cond["type"], cond["status"], cond["reason"]) == (
        "FailedScheduling", "True", "NoMatchingModel")
    assert "family=llama" in cond["message"]
    line = await door.logged(1)
    assert (line["route"], line["status"], line["error"]) == ("nothing", 503,
                                                              "no_matching_model")


async def test_an_over_long_prompt_to_a_route_whose_candidates_sleep_wakes_none(
        door: Door) -> None:
    door.pool(SLEEPY)
    await door.start()
    door.write("chat", route("chat"))
    await two_models(door, small_stays_awake=False, **{"--max-model-len": "64"})
    long_text = " ".join(["word"] * 300)
    status, body, _ = await door.post("/v1/chat/completions", {
        "model": "chat", "messages": [{"role": "user", "content": long_text}]})
    assert status == 400, body
    assert (body["error"]["code"], body["error"]["param"]) == ("context_length_exceeded",
                                                               "messages")
    assert "resulted in 301 tokens" in body["error"]["message"]  # the sleeping engine counted
    status, body, _ = await door.post("/v1/chat/completions", {
        "model": "chat", "messages": CHAT, "max_tokens": 65})
    assert status == 400 and body["error"]["param"] == "max_tokens", body
    assert door.wakes("big") == 0 and door.wakes("small") == 0
    for name in ("big", "small"):
        assert door.status(name).phase == "Sleeping"  # type: ignore[union-attr]


async def test_a_held_route_call_is_served_by_a_candidate_woken_meanwhile_before_the_preferred(
        door: Door) -> None:
    door.pool(SLEEPY)
    await door.start()
    door.write("chat", route("chat", tolerance=10))
    door.write("big", labelled("big", {"family": "qwen", "tier": "big"},
                               args={"--sim-wake-seconds": "12"}))
    door.write("small", labelled("small", {"family": "qwen", "tier": "small"},
                                 args={"--sim-wake-seconds": "0.3"}))
    await door.phase("big", "Sleeping", 60)
    await door.phase("small", "Sleeping", 60)
    started = time.monotonic()
    held = asyncio.ensure_future(door.chat("chat"))  # chooses to wake big, and waits for it
    await door.until("big waking", lambda: getattr(door.status("big"), "phase", None)
                     == "Activating", 10)
    assert not held.done()
    status, body, _ = await door.chat("small")  # small woken by a direct call meanwhile
    assert status == 200, body
    status, body, headers = await held
    assert time.monotonic() - started < 12.0  # before big finished waking
    assert status == 200, body
    assert (headers["x-route-model"], headers["x-route-choice"],
            headers["x-route-rechosen-from"]) == ("small", "warm", "default/big")
    assert getattr(door.status("big"), "phase", None) == "Activating"  # wake not cancelled
    await door.logged(2)
    lines = [line for line in door.access() if line.get("route") == "chat"]
    assert [(line["route_choice"], line["route_rechosen_from"], line["model"])
            for line in lines] == [("warm", "default/big", "small")]
    text = await door.metrics()
    assert metric(text, "aibrix:door_route_choices_total", route="chat", kind="warm",
                  model="small") == 1.0
    assert metric(text, "aibrix:door_route_choices_total", route="chat", kind="woken",
                  model="big") in (None, 0.0)
    await door.until("big woke", lambda: door.wakes("big") == 1, 30)


async def big_and_one_slot_small(door: Door, big_wakes_s: str, **settings: Any) -> Forwards:
    """The route ``chat`` over ``big`` (preferred, asleep, waking in ``big_wakes_s``) and
    ``small`` (awake for good, one call at a time, 2 s each); the door's forwards book."""
    door.pool(SLEEPY)
    await door.start(**settings)
    door.write("chat", route("chat", tolerance=10))
    door.write("big", labelled("big", {"family": "qwen", "tier": "big"},
                               args={"--sim-wake-seconds": big_wakes_s}))
    door.write("small", labelled("small", {"family": "qwen", "tier": "small"}, never_sleep=True,
                                 args={"--max-num-seqs": "1", "--sim-request-seconds": "2"}))
    await door.phase("big", "Sleeping", 60)
    await door.phase("small", "Active", 60)
    assert door.app is not None and door.app.door is not None
    return door.app.door.door.forwards


async def beside_a_call_on(door: Door, forwards: Forwards, model: str) -> tuple[int, Any, Any]:
    """A call to the route ``chat`` sent while a direct call to ``model`` is in flight (it
    answers 200 too)."""
    busy = asyncio.ensure_future(door.chat(model))
    await door.until(f"{model} busy", lambda: bool(forwards.in_flight(("default", model))))
    answer = await door.chat("chat")
    assert (await busy)[0] == 200
    return answer


async def test_a_full_warm_candidate_does_not_keep_the_preferred_asleep_while_its_room_is_free(
        door: Door) -> None:
    """small (in tolerance) runs one call at a time, 2 s each, and has one in flight; big (the
    preferred) sleeps in a pool that keeps a sleeping model's room, so the door's view knows
    it can wake now: it is woken, before and after the door has seen small's 2 s calls (the
    seed's order: free room is used before queueing is weighed against making room; that
    weighing is ``tests.test_door_made_room``'s)."""
    forwards = await big_and_one_slot_small(door, big_wakes_s="0.3")

    async def beside_a_call_in_flight_on_small() -> tuple[int, Any, Any]:
        return await beside_a_call_on(door, forwards, "small")

    status, body, headers = await beside_a_call_in_flight_on_small()
    assert status == 200, body
    assert (headers["x-route-model"], headers["x-route-choice"]) == ("big", "woken")
    assert "x-route-slept" not in headers
    assert 1.9 < (forwards.latency(("default", "small")) or 0) < 3.0
    await door.phase("big", "Sleeping", 30)  # idle again
    status, body, headers = await beside_a_call_in_flight_on_small()
    assert status == 200, body
    assert (headers["x-route-model"], headers["x-route-choice"]) == ("big", "woken")
    assert door.wakes("big") == 2
    text = await door.metrics()
    assert metric(text, "aibrix:door_route_choices_total", route="chat", kind="woken",
                  model="big") == 2.0


async def test_a_held_route_call_takes_a_slot_that_comes_free_on_a_warm_candidate(
        door: Door) -> None:
    """small (in tolerance) runs one call at a time and has one in flight for 2 s; with no
    latency seen yet its queue counts 30 s, so the route call is held for big's wake (12 s).
    When small's call ends its slot is free: the held call takes it then, not at its next look
    (``recheck_s``, 30 s here so that only the freed slot can wake it) nor when big is up."""
    forwards = await big_and_one_slot_small(door, big_wakes_s="12", recheck_s=30)
    started = time.monotonic()
    status, body, headers = await beside_a_call_on(door, forwards, "small")
    assert status == 200, body
    assert (headers["x-route-model"], headers["x-route-choice"],
            headers["x-route-rechosen-from"]) == ("small", "warm", "default/big")
    assert time.monotonic() - started < 10.0  # small's 2 s and its own 2 s, not big's 12 s wake
    await door.until("big woke", lambda: door.wakes("big") == 1, 30)  # its wake went on
