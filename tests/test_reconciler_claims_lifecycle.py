"""Sleep, wake and KV division against fake agents: idle models asleep, woken models served,
room made by sleeping the longest idle, limits shrunk before they grow."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.quantity import GiB
from agent_client import Reply
from tests.reconciler_fakes import FakeAgent, Rig, claim_yaml

pytestmark = [pytest.mark.timeout(30), pytest.mark.loop_guard]
IDLE_POLICY = '{"lifecycle": {"sleepAfterSeconds": 60}}'
ROOM_POLICY = ('{"lifecycle": {"sleepAfterSeconds": 600, "noWakeReserveWhileAsleep": true, '
               '"sleepToMakeRoomAfterSeconds": 30}}')


async def active_claim(rig: Rig, agent: FakeAgent, name: str) -> None:
    await rig.reconcile(name)
    model = rig.status(name).model_name
    agent.serve(model)
    await rig.reconcile(name)
    assert rig.status(name).phase == "Active", rig.status(name)


async def asleep_beside(rig: Rig, agent: FakeAgent, *awake: str) -> None:
    """Claim ``sleeper`` Active, then asleep; then each of ``awake`` Active, in order."""
    await active_claim(rig, agent, "sleeper")
    await agent.sleep("sleeper")
    await rig.reconcile("sleeper")
    for name in awake:
        await active_claim(rig, agent, name)


async def sleeper_old_and_new(tmp_path: Path) -> tuple[Rig, FakeAgent]:
    """An 8 GiB card (7 usable: two 3 GiB models awake at most): 'sleeper' asleep, 'old' idle
    60 s and 'new' idle 40 s, both past sleepToMakeRoomAfterSeconds."""
    a = FakeAgent("agent-a", card=8 * GiB)
    claims = "".join(claim_yaml(n, footprint="2Gi") for n in ("old", "new", "sleeper"))
    rig = Rig(tmp_path, [a], claims, policy=ROOM_POLICY)
    await asleep_beside(rig, a, "old")
    rig.clock.advance(20)
    await active_claim(rig, a, "new")
    rig.clock.advance(40)
    return rig, a


# ---- idle sleep -------------------------------------------------------------------------------


async def test_an_idle_model_sleeps_after_the_policy_time_and_not_before(tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=IDLE_POLICY)
    await active_claim(rig, a, "m")
    result = await rig.reconcile("m", advance=30)
    assert a.calls_of("sleep") == [] and result.requeue_after is not None
    assert 29 < result.requeue_after <= 30.2
    await rig.reconcile("m", advance=result.requeue_after)
    assert a.calls_of("sleep") == [("sleep", "m", 1)]
    st = rig.status("m")
    assert (st.phase, st.reason("Ready")) == ("Sleeping", "EngineSleeping")
    assert rig.events("m")[-1] == "Sleeping"
    assert "m" not in rig.deps.books.holds


async def test_a_model_that_takes_requests_stays_awake(tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=IDLE_POLICY)
    await active_claim(rig, a, "m")
    for _ in range(4):
        a.set("m", request_success_total=a.models["m"]["request_success_total"] + 1)
        await rig.reconcile("m", advance=30)
    assert a.calls_of("sleep") == []


async def test_a_model_busy_at_the_last_look_stays_on_the_route_and_awake(tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=IDLE_POLICY)
    await active_claim(rig, a, "m")
    first = a.snapshots + 1  # the reconcile's snapshot is idle, the last look is not
    a.on_snapshot = lambda n: a.set("m", requests_running=1.0) if n > first else None
    await rig.reconcile("m", advance=61)
    assert a.snapshots == first + 1 and a.calls_of("sleep") == []
    assert rig.status("m").phase == "Active" and "m" not in rig.deps.books.holds


async def test_a_request_sent_straight_to_the_engine_before_the_idle_sleep_keeps_it_awake(
        tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=IDLE_POLICY)
    await active_claim(rig, a, "m")
    # The agent's scrape backed off (its snapshot still says 0 served); the engine itself has
    # just finished a request that came past the door. Only the last look's read shows it.
    a.live["m"] = {"request_success_total": 1.0}
    result = await rig.reconcile("m", advance=61)
    assert a.calls_of("fresh_snapshot") == [("fresh_snapshot", ("m",))]
    assert a.calls_of("sleep") == [] and rig.status("m").phase == "Active"
    assert "m" not in rig.deps.books.holds and result.requeue_after == 60


async def test_an_engine_that_does_not_answer_the_last_look_is_not_put_to_sleep(
        tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=IDLE_POLICY)
    await active_claim(rig, a, "m")
    a.fresh_answers = False  # its figures are only the old scrape's: no judgement on them
    await rig.reconcile("m", advance=61)
    assert a.calls_of("sleep") == [] and rig.status("m").phase == "Active"
    a.fresh_answers = True
    await rig.reconcile("m", advance=61)
    assert a.calls_of("sleep") == [("sleep", "m", 1)]


# ---- wake -------------------------------------------------------------------------------------


async def test_a_wake_request_wakes_a_sleeping_model_where_it_is(tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=IDLE_POLICY)
    await active_claim(rig, a, "m")
    await rig.reconcile("m", advance=61)
    assert rig.status("m").phase == "Sleeping"
    req, new = rig.deps.books.wakes.request("m", ("default", "m"), rig.clock.now(), 0.0)
    again, repeated = rig.deps.books.wakes.request("m", ("default", "m"), rig.clock.now(), 0.0)
    assert new and not repeated and again is req
    await rig.reconcile("m")
    assert a.calls_of("wake") == [("wake", "m")]
    await rig.reconcile("m")
    st = rig.status("m")
    assert st.phase == "Active" and rig.events("m")[-2:] == ["Waking", "Woken"]
    assert rig.deps.books.wakes.get("m") is None


async def test_waking_makes_room_by_sleeping_the_longest_idle_model_first(tmp_path: Path) -> None:
    rig, a = await sleeper_old_and_new(tmp_path)
    rig.deps.books.wakes.request("sleeper", ("default", "sleeper"), rig.clock.now(), 0.0)
    await rig.reconcile("sleeper")
    assert a.calls_of("sleep")[-1] == ("sleep", "old", 1)
    assert rig.status("sleeper").reason("Ready") == "WaitingForRoom"
    assert rig.events("old")[-1] == "SleptToMakeRoom"
    assert rig.status("old").phase == "Sleeping"
    await rig.reconcile("sleeper")
    assert a.calls_of("wake") == [("wake", "sleeper")]
    assert ("sleep", "new", 1) not in a.calls


async def test_a_model_that_served_a_request_sent_straight_to_it_is_not_slept_for_room(
        tmp_path: Path) -> None:
    rig, a = await sleeper_old_and_new(tmp_path)
    a.live["old"] = {"request_success_total": 1.0}  # only its engine knows: scrapes backed off
    rig.deps.books.wakes.request("sleeper", ("default", "sleeper"), rig.clock.now(), 0.0)
    await rig.reconcile("sleeper")
    assert ("fresh_snapshot", ("old",)) in a.calls
    assert ("sleep", "old", 1) not in a.calls and rig.status("old").phase == "Active"


async def test_a_model_that_cannot_wake_where_it_is_moves_to_an_agent_with_room(
        tmp_path: Path) -> None:
    a, b = FakeAgent("agent-a"), FakeAgent("agent-b")
    rig = Rig(tmp_path, [a, b], claim_yaml("m"), policy=IDLE_POLICY)
    a.add("m", "sleeping", claim=("default", "m"), sleeping_footprint_bytes=GiB)
    a.wake_reply = Reply(409, {"status": "error", "reason": "InsufficientGPUMemory",
                               "message": "needs 7.0 GiB, 1.0 GiB free"})
    rig.deps.books.wakes.request("m", ("default", "m"), rig.clock.now(), 0.0)
    for _ in range(2):  # the agent's measurements may be catching up: it is asked again first
        await rig.reconcile("m", advance=0.25)
        assert rig.status("m").reason("Ready") == "WaitingForRoom"
        assert a.calls_of("deactivate") == [] and b.calls_of("activate") == []
    await rig.reconcile("m", advance=0.25)
    assert len(a.calls_of("wake")) == 3
    assert a.calls_of("deactivate") == [("deactivate", "m")]
    assert len(b.calls_of("activate")) == 1
    assert "Rescheduled" in rig.events("m")


async def test_a_view_from_before_a_sleep_for_room_does_not_end_its_settling(
        tmp_path: Path) -> None:
    a = FakeAgent("agent-a", card=8 * GiB)
    claims = "".join(claim_yaml(n, footprint="2Gi") for n in ("old", "new", "sleeper"))
    rig = Rig(tmp_path, [a], claims, policy=ROOM_POLICY)
    await asleep_beside(rig, a, "old", "new")
    rig.clock.advance(60)
    before = await rig.deps.reader.world()  # another pass's view, taken before the sleep below
    rig.deps.books.wakes.request("sleeper", ("default", "sleeper"), rig.clock.now(), 0.0)
    await rig.reconcile("sleeper")
    assert a.calls_of("sleep")[-1] == ("sleep", "old", 1)
    life = rig.claims.life
    assert life.settling(before, "agent-a"), "a view that shows 'old' awake predates its sleep"
    rig.clock.advance(0.2)
    assert not life.settling(await rig.deps.reader.world(), "agent-a")  # asleep and measured


async def test_a_model_that_refuses_to_sleep_for_room_is_passed_over(tmp_path: Path) -> None:
    rig, a = await sleeper_old_and_new(tmp_path)
    a.sleep_refused.add("old")  # the longest idle, but its host memory is short
    rig.deps.books.wakes.request("sleeper", ("default", "sleeper"), rig.clock.now(), 0.0)
    await rig.reconcile("sleeper")
    assert a.calls_of("sleep")[-1] == ("sleep", "old", 1)
    await rig.reconcile("sleeper")
    assert a.calls_of("sleep")[-1] == ("sleep", "new", 1), "not old again"
    await rig.reconcile("sleeper")
    assert a.calls_of("wake") == [("wake", "sleeper")]
    assert [c[1] for c in a.calls_of("sleep")].count("old") == 1


async def test_an_agent_that_cannot_measure_a_sleep_stops_sleeping_models_for_room(
        tmp_path: Path) -> None:
    rig, a = await sleeper_old_and_new(tmp_path)
    a.measures_sleep = False
    rig.deps.books.wakes.request("sleeper", ("default", "sleeper"), rig.clock.now(), 0.0)
    await rig.reconcile("sleeper")
    assert a.calls_of("sleep")[-1] == ("sleep", "old", 1)
    await rig.reconcile("sleeper", advance=11)  # settle_timeout passes: 'old' still unmeasured
    await rig.reconcile("sleeper")
    assert ("sleep", "new", 1) not in a.calls, "it would free nothing the plan could see"
    assert rig.status("sleeper").reason("Ready") == "WaitingForRoom"


async def test_room_made_for_a_waking_model_is_not_given_to_a_new_claim(tmp_path: Path) -> None:
    a = FakeAgent("agent-a", card=8 * GiB)
    claims = "".join(claim_yaml(n, footprint="2Gi") for n in ("old", "new", "sleeper", "late"))
    rig = Rig(tmp_path, [a], claims, policy=ROOM_POLICY)
    await asleep_beside(rig, a, "old", "new")
    rig.clock.advance(60)
    rig.deps.books.wakes.request("sleeper", ("default", "sleeper"), rig.clock.now(), 0.0)
    await rig.reconcile("sleeper")
    assert a.calls_of("sleep")[-1] == ("sleep", "old", 1)  # 3 GiB free now: sleeper's room
    await rig.reconcile("late")
    assert [c for c in a.calls_of("activate") if c[1].model_name == "late"] == []
    await rig.reconcile("sleeper")
    assert a.calls_of("wake") == [("wake", "sleeper")]


async def test_a_wake_the_agent_keeps_refusing_plans_for_its_shortfall(tmp_path: Path) -> None:
    a = FakeAgent("agent-a", card=8 * GiB)  # 7 GiB usable
    claims = "".join(claim_yaml(n, footprint="2Gi") for n in ("old", "sleeper"))
    rig = Rig(tmp_path, [a], claims, policy=ROOM_POLICY)
    await asleep_beside(rig, a, "old")
    rig.clock.advance(60)
    # By the claims' figures sleeper fits beside old (3 of 4 GiB); the agent, which measures,
    # finds 2 GiB short.
    a.wake_reply = Reply(409, {"status": "error", "reason": "InsufficientGPUMemory",
                               "message": "needs 3.0 GiB, 1.0 GiB free",
                               "needed_bytes": 3 * GiB, "free_bytes": 1 * GiB})
    rig.deps.books.wakes.request("sleeper", ("default", "sleeper"), rig.clock.now(), 0.0)
    for _ in range(3):
        await rig.reconcile("sleeper")
    assert len(a.calls_of("wake")) == 3 and a.calls_of("sleep")[-1][1] == "sleeper"
    await rig.reconcile("sleeper")  # now planned with the shortfall: old makes room
    assert a.calls_of("sleep")[-1] == ("sleep", "old", 1)
    assert rig.status("sleeper").reason("Ready") == "WaitingForRoom"
    a.wake_reply = None
    await rig.reconcile("sleeper")
    assert len(a.calls_of("wake")) == 4 and a.models["sleeper"]["phase"] == "active"


async def test_a_wake_call_without_an_answer_keeps_the_request(tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=IDLE_POLICY)
    a.add("m", "sleeping", claim=("default", "m"))
    a.wake_reply = Reply(503, {"message": "agent-a: connection reset"})
    rig.deps.books.wakes.request("m", ("default", "m"), rig.clock.now(), 0.0)
    result = await rig.reconcile("m")
    assert rig.deps.books.wakes.get("m") is not None and "WakeFailed" not in rig.events("m")
    assert result.requeue_after == 1.0
    a.wake_reply = None
    await rig.reconcile("m", advance=1.0)
    assert a.calls_of("wake") == [("wake", "m"), ("wake", "m")]
    assert a.models["m"]["phase"] == "active"


async def test_a_wake_with_no_room_anywhere_waits_then_expires(tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=IDLE_POLICY)
    a.add("m", "sleeping", claim=("default", "m"))
    a.wake_reply = Reply(409, {"status": "error", "reason": "InsufficientGPUMemory",
                               "message": "no room"})
    rig.deps.books.wakes.request("m", ("default", "m"), rig.clock.now(), 0.0)
    for _ in range(3):
        result = await rig.reconcile("m", advance=0.25)
    assert rig.status("m").reason("Ready") == "WaitingForRoom" and result.requeue_after == 5.0
    await rig.reconcile("m", advance=301)
    assert rig.deps.books.wakes.get("m") is None
    assert rig.status("m").reason("Ready") == "EngineSleeping"


async def test_a_failed_wake_removes_the_request(tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=IDLE_POLICY)
    a.add("m", "sleeping", claim=("default", "m"))
    a.wake_reply = Reply(502, {"status": "error", "message": "wake of 'm' failed"})
    rig.deps.books.wakes.request("m", ("default", "m"), rig.clock.now(), 0.0)
    await rig.reconcile("m")
    assert rig.deps.books.wakes.get("m") is None and rig.events("m")[-1] == "WakeFailed"


async def test_a_new_claim_gets_room_by_sleeping_an_idle_model(tmp_path: Path) -> None:
    a = FakeAgent("agent-a", card=8 * GiB)
    claims = "".join(claim_yaml(n, footprint="2Gi") for n in ("one", "two", "three"))
    rig = Rig(tmp_path, [a], claims, policy=ROOM_POLICY)
    await active_claim(rig, a, "one")
    await active_claim(rig, a, "two")
    rig.clock.advance(31)
    await rig.reconcile("three")
    assert rig.status("three").reason("Scheduled") == "MakingRoom"
    assert a.calls_of("sleep") == [("sleep", "one", 1)]
    await rig.reconcile("three")
    assert rig.status("three").phase == "Activating"


# ---- KV division ------------------------------------------------------------------------------


async def test_kv_limits_are_divided_shrinks_first_and_recorded_on_the_claims(
        tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    claims = claim_yaml("p") + claim_yaml("q")
    rig = Rig(tmp_path, [a], claims)
    await active_claim(rig, a, "p")
    await rig.kv.reconcile("agent-a")
    assert a.calls_of("kv_limit") == [("kv_limit", "p", 9 * GiB)]  # 15 - 6: one engine
    await active_claim(rig, a, "q")
    a.calls.clear()
    await rig.kv.reconcile("agent-a")
    # p shrinks from 9 GiB before q grows from its floor: 15 - 12 - 2 = 1 GiB spare, halved
    assert a.calls_of("kv_limit") == [("kv_limit", "p", int(1.5 * GiB)),
                                      ("kv_limit", "q", int(1.5 * GiB))]
    limits = [rig.status(n).instance.kv_limit_bytes for n in "pq"]  # type: ignore[union-attr]
    assert limits == [int(1.5 * GiB)] * 2 and sum(limits) + 12 * GiB <= 15 * GiB
    assert rig.events("q")[-1] == "KVLimitSet"


async def test_a_shrink_the_agent_does_not_confirm_stops_every_grow(tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("p") + claim_yaml("q"))
    await active_claim(rig, a, "p")
    await rig.kv.reconcile("agent-a")
    await active_claim(rig, a, "q")
    a.calls.clear()
    a.unconfirmed_kv.add("p")
    result = await rig.kv.reconcile("agent-a")
    assert a.calls_of("kv_limit") == [("kv_limit", "p", int(1.5 * GiB))]
    assert result.requeue_after == 1.0


async def test_a_sleeping_footprint_never_measured_is_reported_once(tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=ROOM_POLICY)
    a.add("m", "sleeping", claim=("default", "m"))  # sleeping_footprint_bytes None
    result = await rig.reconcile("m")
    assert result.requeue_after is not None and "SleepingFootprintUnknown" not in rig.events("m")
    for _ in range(2):
        await rig.reconcile("m", advance=11)
    assert rig.events("m").count("SleepingFootprintUnknown") == 1
