"""The claim reconciler's decisions against fake agents: placing, following engines, failures,
lost engines and deletion. Fake clock, no processes, no sleeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.quantity import GiB
from agent_client import Reply
from reconciler.planning.placement import RETRY_EVERY
from tests.reconciler_fakes import FakeAgent, Rig, claim_yaml

pytestmark = [pytest.mark.timeout(30), pytest.mark.loop_guard]
TWO = claim_yaml("qwen3-0-6b", "qwen3-0.6b") + claim_yaml("qwen25-0-5b", "qwen2.5-0.5b")


@pytest.fixture
def a() -> FakeAgent:
    return FakeAgent("agent-a")


@pytest.fixture
def b() -> FakeAgent:
    return FakeAgent("agent-b")


# ---- placing ----------------------------------------------------------------------------------


async def test_a_new_claim_is_activated_with_its_per_gpu_claim_ref_and_a_first_kv_limit(
        tmp_path: Path, a: FakeAgent) -> None:
    rig = Rig(tmp_path, [a], TWO)
    result = await rig.reconcile("qwen3-0-6b")
    (_, spec), = a.calls_of("activate")
    assert (spec.model_name, spec.claim_namespace, spec.claim_name) == ("qwen3-0.6b", "default",
                                                                        "qwen3-0-6b")
    assert (spec.maximum_footprint_bytes, spec.kv_floor_bytes) == (6 * GiB, 1 * GiB)
    assert spec.kv_limit_bytes == 1 * GiB and spec.args == {"--max-model-len": "2048"}
    assert spec.claim_uid == rig.status("qwen3-0-6b").uid
    st = rig.status("qwen3-0-6b")
    assert st.phase == "Activating"
    assert (st.reason("Scheduled"), st.reason("Ready")) == ("Placed", "EngineStarting")
    assert st.instance is not None and st.instance.agent == "agent-a"
    assert rig.kv_kicks == ["agent-a"] and result.requeue_after is not None


async def test_a_ready_engine_within_its_kv_limit_makes_the_claim_active(
        tmp_path: Path, a: FakeAgent) -> None:
    rig = Rig(tmp_path, [a], TWO)
    await rig.reconcile("qwen3-0-6b")
    a.serve("qwen3-0.6b")
    await rig.reconcile("qwen3-0-6b")
    st = rig.status("qwen3-0-6b")
    assert (st.phase, st.reason("Ready")) == ("Active", "ModelClaimActive")
    assert st.instance is not None and st.instance.port == a.models["qwen3-0.6b"]["port"]
    assert rig.events("qwen3-0-6b") == ["Activated"]


async def test_a_ready_engine_without_its_kv_limit_stays_off_the_route(
        tmp_path: Path, a: FakeAgent) -> None:
    rig = Rig(tmp_path, [a], TWO)
    await rig.reconcile("qwen3-0-6b")
    a.set("qwen3-0.6b", phase="active", kv_limit_applied_bytes=None)
    await rig.reconcile("qwen3-0-6b")
    st = rig.status("qwen3-0-6b")
    assert (st.phase, st.reason("Ready")) == ("Activating", "EngineStarting")
    assert "KV limit" in st.conditions["Ready"].message


async def test_a_restarting_engine_reads_activating_with_its_last_error(
        tmp_path: Path, a: FakeAgent) -> None:
    rig = Rig(tmp_path, [a], TWO)
    await rig.reconcile("qwen3-0-6b")
    a.set("qwen3-0.6b", phase="restarting", restart_count=2, last_error="exit 1\nboom")
    await rig.reconcile("qwen3-0-6b")
    st = rig.status("qwen3-0-6b")
    assert (st.phase, st.reason("Ready")) == ("Activating", "EngineStarting")
    assert "restart 2" in st.conditions["Ready"].message and "exit 1" in \
        st.conditions["Ready"].message


async def test_claims_reconciled_one_after_the_other_never_share_the_same_room(
        tmp_path: Path, a: FakeAgent, b: FakeAgent) -> None:
    claims = "".join(claim_yaml(f"c{i}", footprint="10Gi") for i in range(3))
    rig = Rig(tmp_path, [a, b], claims)
    for name in ("c0", "c1"):
        await rig.claims.reconcile(("default", name))  # no clock move: the same snapshots
    assert len(a.calls_of("activate")) == 1 and len(b.calls_of("activate")) == 1
    await rig.claims.reconcile(("default", "c2"))
    assert rig.status("c2").phase == "Pending"


async def test_a_claim_too_large_for_every_card_stays_pending_too_large(
        tmp_path: Path, a: FakeAgent) -> None:
    rig = Rig(tmp_path, [a], claim_yaml("big", footprint="20Gi"))
    result = await rig.reconcile("big")
    st = rig.status("big")
    assert (st.phase, st.reason("Scheduled")) == ("Pending", "TooLargeForAnyCard")
    assert a.calls_of("activate") == [] and result.requeue_after == RETRY_EVERY


async def test_a_claim_with_no_room_names_the_closest_agent_and_retries_10_20_40_60(
        tmp_path: Path, a: FakeAgent, b: FakeAgent) -> None:
    a.add("x", claim=("default", "x-claim"))
    b.add("y", claim=("default", "y-claim"))
    claims = claim_yaml("x-claim", "x", footprint="10Gi") + \
        claim_yaml("y-claim", "y", footprint="12Gi") + claim_yaml("third", footprint="6Gi")
    rig = Rig(tmp_path, [a, b], claims)
    delays = [(await rig.reconcile("third")).requeue_after for _ in range(5)]
    st = rig.status("third")
    assert (st.phase, st.reason("Scheduled")) == ("Pending", "NoMatchingPods")
    assert st.conditions["Scheduled"].message.startswith("agent-a: needs 7.0 GiB on GPU")
    assert delays == [10.0, 20.0, 40.0, 60.0, 60.0]


async def test_held_claims_get_their_reason_and_no_agent_call(tmp_path: Path,
                                                              a: FakeAgent) -> None:
    claims = claim_yaml("bad-per-gpu", footprint="0") + claim_yaml(
        "bad-args", args={"--gpu-memory-utilization": "0.5"})
    rig = Rig(tmp_path, [a], claims)
    await rig.reconcile("bad-per-gpu")
    await rig.reconcile("bad-args")
    assert (rig.status("bad-per-gpu").phase, rig.status("bad-per-gpu").reason("Scheduled")) == \
        ("Pending", "InvalidPerGPU")
    assert (rig.status("bad-args").phase, rig.status("bad-args").reason("Ready")) == \
        ("Failed", "InvalidEngineConfig")
    assert a.calls == []


async def test_an_agent_refusal_is_recorded_and_retried(tmp_path: Path, a: FakeAgent) -> None:
    a.activate_reply = Reply(409, {"status": "error", "reason": "InsufficientGPUMemory",
                                   "message": "needs 7.0 GiB, 2.0 GiB free"})
    rig = Rig(tmp_path, [a], TWO)
    result = await rig.reconcile("qwen3-0-6b")
    st = rig.status("qwen3-0-6b")
    assert (st.phase, st.reason("Ready")) == ("Failed", "ActivateFailed")
    assert "2.0 GiB free" in st.conditions["Ready"].message and result.requeue_after == 10.0
    a.activate_reply = None
    await rig.reconcile("qwen3-0-6b", advance=10)
    assert rig.status("qwen3-0-6b").phase == "Activating"


async def test_an_activation_a_hand_run_deactivate_raced_is_placed_again_not_failed(
        tmp_path: Path, a: FakeAgent) -> None:
    """A person deactivated a claimed engine and the reconciler's new activation met the stop:
    the agent's 409 DeactivatedMeanwhile was taken for a failed start (Failed for 15 s)."""
    a.activate_reply = Reply(409, {"status": "error", "reason": "DeactivatedMeanwhile",
                                   "message": "model 'qwen3-0.6b' was deactivated by another "
                                   "request while this activation was starting it"})
    rig = Rig(tmp_path, [a], TWO)
    result = await rig.reconcile("qwen3-0-6b")
    st = rig.status("qwen3-0-6b")
    assert (st.phase, st.reason("Ready")) == ("Pending", "NotPlaced")
    assert result.requeue_after is not None and result.requeue_after < 10.0  # soon, no backoff
    a.activate_reply = None
    await rig.reconcile("qwen3-0-6b", advance=result.requeue_after)
    assert rig.status("qwen3-0-6b").phase == "Activating"


async def test_an_engine_failed_for_good_moves_to_an_agent_with_room(
        tmp_path: Path, a: FakeAgent, b: FakeAgent) -> None:
    rig = Rig(tmp_path, [a, b], TWO)
    await rig.reconcile("qwen3-0-6b")
    (first,) = [x for x in (a, b) if x.calls_of("activate")]
    other = b if first is a else a
    first.set("qwen3-0.6b", phase="failed", restart_count=5, last_error="killed by signal 9")
    await rig.reconcile("qwen3-0-6b")
    assert first.calls_of("deactivate") == [("deactivate", "qwen3-0.6b")]
    assert len(other.calls_of("activate")) == 1
    assert rig.events("qwen3-0-6b") == ["EngineFailed", "Rescheduled"]
    st = rig.status("qwen3-0-6b")
    assert st.phase == "Activating" and st.instance is not None and st.instance.agent == \
        other.name


async def test_an_engine_failed_for_good_with_nowhere_to_go_reads_failed_and_says_why(
        tmp_path: Path, a: FakeAgent) -> None:
    rig = Rig(tmp_path, [a], TWO)
    await rig.reconcile("qwen3-0-6b")
    a.set("qwen3-0.6b", phase="failed", restart_count=5, last_error="exit 3")
    await rig.reconcile("qwen3-0-6b")
    st = rig.status("qwen3-0-6b")
    assert (st.phase, st.reason("Ready")) == ("Failed", "EngineFailed")
    assert st.conditions["Scheduled"].message.startswith("cannot move")
    assert a.calls_of("deactivate") == []


async def test_an_engine_gone_from_its_agent_is_placed_again(tmp_path: Path,
                                                             a: FakeAgent) -> None:
    rig = Rig(tmp_path, [a], TWO)
    await rig.reconcile("qwen3-0-6b")
    a.serve("qwen3-0.6b")
    await rig.reconcile("qwen3-0-6b")
    del a.models["qwen3-0.6b"]
    await rig.reconcile("qwen3-0-6b")
    assert len(a.calls_of("activate")) == 2
    assert "Rescheduled" in rig.events("qwen3-0-6b")
    assert rig.status("qwen3-0-6b").phase == "Activating"


async def test_a_silent_agent_keeps_its_claims_for_the_grace_period_then_loses_them(
        tmp_path: Path, a: FakeAgent, b: FakeAgent) -> None:
    rig = Rig(tmp_path, [a, b], TWO)
    await rig.reconcile("qwen3-0-6b")
    (first,) = [x for x in (a, b) if x.calls_of("activate")]
    first.serve("qwen3-0.6b")
    await rig.reconcile("qwen3-0-6b")
    first.reachable = False
    await rig.reconcile("qwen3-0-6b", advance=5)
    assert rig.status("qwen3-0-6b").reason("Ready") == "EngineStarting"
    assert "does not answer" in rig.status("qwen3-0-6b").conditions["Ready"].message
    await rig.reconcile("qwen3-0-6b", advance=30)
    other = b if first is a else a
    assert len(other.calls_of("activate")) == 1
    assert rig.status("qwen3-0-6b").instance.agent == other.name  # type: ignore[union-attr]


async def test_a_second_engine_of_the_claim_is_stopped(tmp_path: Path, a: FakeAgent,
                                                       b: FakeAgent) -> None:
    a.add("qwen3-0.6b", claim=("default", "qwen3-0-6b"), kv_limit_applied_bytes=GiB)
    b.add("qwen3-0.6b", claim=("default", "qwen3-0-6b"), kv_limit_applied_bytes=GiB)
    rig = Rig(tmp_path, [a, b], TWO)
    await rig.reconcile("qwen3-0-6b")
    assert len(a.calls_of("deactivate")) + len(b.calls_of("deactivate")) == 1
    assert rig.status("qwen3-0-6b").phase == "Active"


# ---- deletion ---------------------------------------------------------------------------------


async def test_a_deleted_claim_drains_its_requests_then_stops_and_forgets(
        tmp_path: Path, a: FakeAgent) -> None:
    rig = Rig(tmp_path, [a], TWO)
    await rig.reconcile("qwen3-0-6b")
    a.serve("qwen3-0.6b")
    a.set("qwen3-0.6b", requests_running=2.0)
    await rig.reconcile("qwen3-0-6b")
    rig.write_claims(claim_yaml("qwen25-0-5b", "qwen2.5-0.5b"))
    result = await rig.reconcile("qwen3-0-6b")
    assert result.requeue_after is not None and a.calls_of("deactivate") == []
    assert rig.status("qwen3-0-6b").deleted is not None  # off the route
    a.set("qwen3-0.6b", requests_running=0.0)
    await rig.reconcile("qwen3-0-6b")
    assert a.calls_of("deactivate") == [("deactivate", "qwen3-0.6b")]
    assert rig.store.get(("default", "qwen3-0-6b")) is None


async def test_a_deleted_claim_still_busy_after_90_seconds_is_stopped_with_drain_timed_out(
        tmp_path: Path, a: FakeAgent) -> None:
    rig = Rig(tmp_path, [a], TWO)
    await rig.reconcile("qwen3-0-6b")
    a.serve("qwen3-0.6b")
    a.set("qwen3-0.6b", requests_waiting=1.0)
    rig.write_claims("# every claim deleted\n")  # an empty file reads as one being written
    await rig.reconcile("qwen3-0-6b")
    st = rig.status("qwen3-0-6b")
    await rig.reconcile("qwen3-0-6b", advance=89)
    assert a.calls_of("deactivate") == []
    await rig.reconcile("qwen3-0-6b", advance=1.5)
    assert a.calls_of("deactivate") == [("deactivate", "qwen3-0.6b")]
    assert [e.reason for e in st.events][-1] == "DrainTimedOut"


async def test_an_engine_answering_to_an_unknown_claim_is_stopped(tmp_path: Path,
                                                                  a: FakeAgent) -> None:
    a.add("orphan", "sleeping", claim=("default", "gone"))
    rig = Rig(tmp_path, [a], TWO)
    await rig.reconcile("gone")
    assert a.calls_of("deactivate") == [("deactivate", "orphan")]


async def test_a_deleted_claim_wakes_the_claims_waiting_for_room(tmp_path: Path,
                                                                 a: FakeAgent) -> None:
    claims = claim_yaml("one", footprint="10Gi") + claim_yaml("two", footprint="10Gi")
    rig = Rig(tmp_path, [a], claims)
    await rig.reconcile("one")
    await rig.reconcile("two")
    assert rig.status("two").phase == "Pending"
    rig.write_claims(claim_yaml("two", footprint="10Gi"))
    rig.claim_kicks.clear()
    await rig.reconcile("one")
    assert ("default", "two") in rig.claim_kicks
    await rig.reconcile("two")
    assert rig.status("two").phase == "Activating"
