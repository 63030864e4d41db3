"""A route's made-room choice through the front door, end to end (issue 24, item 4): the door
reads the sleeping preferred claim's GPU from the agent's snapshot, picks the victims by need
(not the reconciler's longest-idle order), carries them on the wake request, and the answer
names them. A real agent with simulated engines on one simulated 16 GiB card (15 GiB usable),
the reconciler and its door in this process (``tests.test_door_integration``'s ``Door``)."""

from __future__ import annotations

import asyncio

import pytest

from reconciler.door.forwards import Forwards
from tests.test_door_integration import Door, door, metric
from tests.test_door_modelroute import beside_a_call_on, labelled, route

__all__ = ["door"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]
# Idle models sleep after 1 s; a sleeping one keeps only what it holds asleep, and an awake one
# idle for 1 s may be slept to make room for a wake.
MAKES_ROOM = ('{"lifecycle": {"sleepAfterSeconds": 1, "noWakeReserveWhileAsleep": true, '
              '"sleepToMakeRoomAfterSeconds": 1}}')
STAYS_AWAKE = "claim.model.aibrix.ai/lifecycle: '{\"sleepAfterSeconds\": 600}'"


def only(name: str) -> str:
    """A route whose only candidate is the claim labelled ``name``."""
    return f"""apiVersion: model.aibrix.ai/v1alpha1
kind: ModelRoute
metadata: {{name: to-{name}}}
spec:
  require: {{matchLabels: {{app: {name}}}}}
  tolerance: 0
"""


def awake_for_long(name: str, footprint: str, labels: dict[str, str] | None = None) -> str:
    """A claim that does not sleep by idle time (600 s) but may be slept for room after 1 s."""
    text = labelled(name, labels or {"app": name}).replace("3Gi", footprint, 1)
    return text.replace("  labels:", f"  annotations:\n    {STAYS_AWAKE}\n  labels:", 1)


async def test_room_for_a_route_call_is_made_by_sleeping_the_least_needed_idle_model(
        door: Door) -> None:
    """``big`` (6 GiB + 1 GiB KV) sleeps; ``a`` and ``b`` (4 + 1 each) are awake and idle, and
    big cannot wake beside both. Either one asleep makes room. ``a`` was used ten times, then
    ``b`` once: the reconciler's own rule would sleep ``a`` (idle longest), the door's sleeps
    ``b`` (less recent use), and the route's answer says so."""
    door.pool(MAKES_ROOM)
    await door.start()
    door.write("big", labelled("big", {"app": "big"}).replace("3Gi", "6Gi", 1))
    await door.phase("big", "Sleeping", 60)
    door.write("a", awake_for_long("a", "4Gi"))
    door.write("b", awake_for_long("b", "4Gi"))
    await door.phase("a", "Active", 60)
    await door.phase("b", "Active", 60)
    door.write("to-big", only("big"))
    for _ in range(10):
        assert (await door.chat("a"))[0] == 200
    assert (await door.chat("b"))[0] == 200
    await asyncio.sleep(1.2)  # both idle past sleepToMakeRoomAfterSeconds, a the longer
    assert door.wakes("big") == 0

    status, body, headers = await door.chat("to-big")
    assert status == 200, body
    assert (headers["x-route-model"], headers["x-route-choice"],
            headers.get("x-route-slept")) == ("big", "made-room", "b")
    assert door.status("b").phase == "Sleeping"  # type: ignore[union-attr]
    assert door.status("a").phase == "Active"  # type: ignore[union-attr]
    line = await door.logged(12)
    assert (line["route"], line["route_choice"], line["route_slept"]) == (
        "to-big", "made-room", "b")
    text = await door.metrics()
    assert metric(text, "aibrix:door_route_choices_total", route="to-big", kind="made-room",
                  model="big") == 1.0
    assert door.app is not None and door.app.door is not None
    assert door.app.door.door.router.book.plans == ()  # the plan ended with the call


async def small_busy_and_a_victim(door: Door) -> Forwards:
    """The route ``chat`` over ``big`` (preferred, asleep, 6 + 1 GiB) and ``small`` (in
    tolerance, never asleep, one call at a time, 2 s each); ``x`` (6 + 1 GiB, no route's) awake
    and idle, so big wakes only if x sleeps."""
    door.pool(MAKES_ROOM)
    await door.start()
    door.write("big", labelled("big", {"family": "qwen", "tier": "big"},
                               args={"--sim-wake-seconds": "0.3"}).replace("3Gi", "6Gi", 1))
    await door.phase("big", "Sleeping", 60)
    door.write("small", labelled("small", {"family": "qwen", "tier": "small"}, never_sleep=True,
                                 args={"--max-num-seqs": "1", "--sim-request-seconds": "2"}))
    door.write("x", awake_for_long("x", "6Gi"))
    await door.phase("small", "Active", 60)
    await door.phase("x", "Active", 60)
    door.write("chat", route("chat", tolerance=10))
    assert door.app is not None and door.app.door is not None
    return door.app.door.door.forwards


async def test_a_full_warm_candidate_queues_a_route_call_or_room_is_made_by_the_figures(
        door: Door) -> None:
    """small has one call in flight and a slot of one; big needs x asleep to wake. With no
    latency seen yet small's call counts 30 s (the seed's), more than big's wake (6 GiB at
    1 GiB/s) plus x's unload (1 s): room is made. Once the door has seen small's 2 s calls and
    x is awake again, the call queues at small instead, and big stays asleep."""
    forwards = await small_busy_and_a_victim(door)
    await asyncio.sleep(1.2)  # x idle past sleepToMakeRoomAfterSeconds
    status, body, headers = await beside_a_call_on(door, forwards, "small")
    assert status == 200, body
    assert (headers["x-route-model"], headers["x-route-choice"],
            headers.get("x-route-slept")) == ("big", "made-room", "x")
    assert 1.9 < (forwards.latency(("default", "small")) or 0) < 3.0
    await door.phase("big", "Sleeping", 30)  # idle again
    assert (await door.chat("x"))[0] == 200  # awake again (big asleep: room for it)
    await asyncio.sleep(1.2)
    status, body, headers = await beside_a_call_on(door, forwards, "small")
    assert status == 200, body
    assert (headers["x-route-model"], headers["x-route-choice"]) == ("small", "queued")
    assert "x-route-slept" not in headers
    assert door.wakes("big") == 1 and getattr(door.status("big"), "phase", None) == "Sleeping"
    assert getattr(door.status("x"), "phase", None) == "Active"
    text = await door.metrics()
    assert metric(text, "aibrix:door_route_choices_total", route="chat", kind="queued",
                  model="small") == 1.0
