"""How an engine owner starts its engine, tested directly over the recording fakes.

What the launcher is handed (the driver's argv, the engine's identity in its environment, the
log the owner later reads), the wait for a port another process holds (a doubling pause capped
at 30 s, told once, no budget spent), the turn on the engine's cards, the weight cache's copy
to start on, Ollama's load after the start, and what the agent log says about each start.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from msgspec.structs import replace

from contract.phases import Phase
from engines.process import SpawnError
from registry.env import ENV_ENGINE_ID, ENV_STATE_DIR
from registry.record import EngineRecord, EngineSpec, PerGpu
from runtime_agent.logs import JsonFormatter
from runtime_agent.supervision.messages import SpawnRetry
from runtime_agent.supervision.owner import EngineOwner
from runtime_agent.supervision.owner import life
from tests.owner_fakes import FakeStager, OwnerRig, fast_settings, make_record

pytestmark = pytest.mark.loop_guard  # the in-process core must not block its loop

HELD = ("port 20000 is held by another process, so the engine cannot listen on it; waiting "
        "for it")


def transitions(rig: OwnerRig, to: str) -> list[tuple[str, str, str]]:
    """(from, reason, message) of each move into ``to``."""
    return [(e.src, e.reason, e.message) for e in rig.events if e.dst == to and e.src != e.dst]


# ---- what the launcher is handed ------------------------------------------------------------


async def test_the_launcher_gets_the_engines_command_identity_and_log(rig: OwnerRig) -> None:
    owner = rig.start()
    assert await asyncio.wait_for(owner.spawned, 5) is None  # started: no error to report
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    assert rig.launcher.argv == [["fake-engine", "hf://org/m"]]  # the driver's command line
    env = rig.launcher.env[0]
    # what re-adoption finds the engine by, and kvcached's segment name for its KV limit
    assert env[ENV_ENGINE_ID] == "e" * 16 and env[ENV_STATE_DIR] == str(rig.settings.state_dir)
    assert env["KVCACHED_IPC_NAME"] == "kvc_m1"
    # its output goes to the file whose tail the owner adds to an exit's cause
    assert rig.launcher.log_paths == [rig.settings.logs_dir / f"{'e' * 16}.log"]
    assert owner.view.log_path == str(rig.launcher.log_paths[0])
    assert transitions(rig, "booting") == [("activating", "activated", "pid 4001 on port 20000")]


async def test_the_port_asked_about_is_the_engines_own_on_the_host_it_binds(
        rig: OwnerRig) -> None:
    asked: list[tuple[int, str]] = []

    def port_free(port: int, host: str) -> bool:
        asked.append((port, host))
        return True

    rig.deps = replace(rig.deps, port_free=port_free)
    owner = rig.start(make_record(port=20123))
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    assert asked == [(20123, rig.settings.engine_bind_host)]


async def test_a_start_that_cannot_spawn_fails_says_why_and_frees_its_memory(
        rig: OwnerRig) -> None:
    stopped = rig.told_memory("stopped")
    rig.launcher.fail_with = SpawnError("no such executable: vllm")
    owner = rig.start()
    await rig.until(lambda: owner.view.phase is Phase.FAILED, "failed")
    assert transitions(rig, "failed") == [
        ("activating", "StartFailed", "cannot start engine: no such executable: vllm")]
    assert stopped == ["m1"]  # what admission reserved for it is free again


# ---- a port held by another process ---------------------------------------------------------


async def start_on_a_held_port(rig: OwnerRig, tries: int) -> EngineOwner:
    """Start an engine whose port another process holds; return once it has waited ``tries``
    times (timers recorded, not waited for)."""
    rig.record_timers()
    rig.port_free = False
    owner = rig.start()
    await rig.until(lambda: len(rig.scheduled(SpawnRetry)) >= tries, f"{tries} tries")
    return owner


async def test_a_held_port_is_tried_again_after_a_doubling_pause_up_to_30_s_told_once(
        rig: OwnerRig) -> None:
    owner = await start_on_a_held_port(rig, tries=8)
    retries = rig.scheduled(SpawnRetry)[:8]
    assert [delay for delay, _ in retries] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert {retry.reason for _, retry in retries} == {"activated"}  # the start's own reason
    assert owner.view.phase is Phase.ACTIVATING and rig.launcher.spawned == []
    assert owner.view.last_error == HELD and "PortHeld" in owner.view.conditions
    assert [e.message for e in rig.events if e.reason == "PortHeld"] == [
        HELD + "; trying again in 1 s and growing"]  # told once, not at every try
    rig.port_free = True
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "started once free")
    assert owner.view.restart_count == 0 and owner.view.conditions == ()
    assert transitions(rig, "booting") == [("activating", "activated", "pid 4001 on port 20000")]


async def test_a_port_held_again_at_a_restart_is_waited_for_from_the_first_pause(
        rig: OwnerRig) -> None:
    owner = await start_on_a_held_port(rig, tries=3)
    rig.port_free = True
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    tries = len(rig.scheduled(SpawnRetry))
    rig.port_free = False  # a stranger takes the port while the engine is down
    rig.launcher.last.exit(code=1)
    await rig.until(lambda: len(rig.scheduled(SpawnRetry)) >= tries + 2, "tries after the crash")
    again = rig.scheduled(SpawnRetry)[tries:tries + 2]
    assert [delay for delay, _ in again] == [1, 2]
    assert {retry.reason for _, retry in again} == {"restart 1"}
    assert [e.message for e in rig.events if e.reason == "PortHeld"] == [
        HELD + "; trying again in 1 s and growing"] * 2  # told again: a new wait
    rig.port_free = True
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE and len(rig.launcher.spawned) == 2,
                    "restarted once free")
    assert transitions(rig, "booting")[-1] == ("restarting", "restart 1", "pid 4002 on port 20000")


# ---- what the agent log says ----------------------------------------------------------------


@pytest.mark.parametrize("simulate", [False, True])
async def test_the_agent_log_says_which_engine_started_where_and_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, simulate: bool) -> None:
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, simulate_engines=simulate))
    try:
        with caplog.at_level(logging.INFO, logger="runtime_agent.supervision.owner"):
            owner = rig.start()
            await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    finally:
        await rig.close()
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records
             if r.getMessage().startswith("engine m1 started")]
    said = "engine m1 started: pid 4001 port 20000 (activated)"
    if simulate:  # an operator must never take a simulated engine for the real one
        said += "; SIMULATED vllm (python -m engines.sim)"
    assert [(line["msg"], line["model"]) for line in lines] == [(said, "m1")]


# ---- Ollama loads its model after the start, unless it is meant to sleep --------------------


def record_of(engine: str, desired: str) -> EngineRecord:
    spec = EngineSpec(model_name="m1", engine=engine, ipc_name="kvc_m1",  # type: ignore[arg-type]
                      artifact_url="ollama://qwen3:0.6b" if engine == "ollama" else "hf://org/m")
    return EngineRecord(engine_id="e" * 16, spec=spec, port=20000, created_at=1.0,
                        last_transition=1.0, desired=desired)  # type: ignore[arg-type]


@pytest.mark.parametrize(("engine", "desired", "prepared"), [
    ("vllm", "awake", True), ("vllm", "asleep", True),
    ("ollama", "awake", True), ("ollama", "asleep", False)])
async def test_a_started_engine_is_prepared_unless_it_is_an_ollama_meant_to_sleep(
        rig: OwnerRig, engine: str, desired: str, prepared: bool) -> None:
    owner = rig.start(record_of(engine, desired))
    await rig.until(lambda: owner.view.phase in (Phase.ACTIVE, Phase.SLEEPING)
                    and "Ready" in rig.reasons(), "ready")
    assert ("prepare" in rig.driver.calls) is prepared


# ---- the turn on the engine's cards ---------------------------------------------------------


async def hold_turn(rig: OwnerRig, devices: list[int], release: asyncio.Event,
                    held: asyncio.Event) -> None:
    async with rig.memory.gate.turn(devices):
        held.set()
        await release.wait()


async def test_an_engine_on_cards_starts_in_its_turn_and_gives_the_turn_back_when_ready(
        rig: OwnerRig) -> None:
    release, held = asyncio.Event(), asyncio.Event()
    other = asyncio.ensure_future(hold_turn(rig, [0], release, held))  # another start on card 0
    await held.wait()
    owner = rig.start(make_record(devices=[0]))
    await rig.until(lambda: rig.memory.gate.waiters(0) == 1, "waiting for its turn")
    assert rig.launcher.spawned == [] and owner.view.phase is Phase.ACTIVATING
    release.set()
    await other
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "started in its turn")
    assert transitions(rig, "booting") == [("activating", "activated", "pid 4001 on port 20000")]
    # ready: the card is free for the next start or wake at once
    mine, got = asyncio.Event(), asyncio.Event()
    next_one = asyncio.ensure_future(hold_turn(rig, [0], mine, got))
    await asyncio.wait_for(got.wait(), 5)
    mine.set()
    await next_one


async def test_a_declared_engine_starts_beside_another_start_on_its_card(
        rig: OwnerRig) -> None:
    release, held = asyncio.Event(), asyncio.Event()
    other = asyncio.ensure_future(hold_shared(rig, [0], release, held))  # a declared start
    await held.wait()
    owner = rig.start(make_record(devices=[0], per_gpu=PerGpu(maximum_footprint_bytes=1 << 30,
                                                              kv_floor_bytes=1 << 29)))
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "started beside the other")
    assert "StartQueued" not in rig.reasons()
    release.set()
    await other


async def test_a_measured_engine_waiting_for_its_card_is_answered_at_once_as_queued(
        rig: OwnerRig) -> None:
    release, held = asyncio.Event(), asyncio.Event()
    other = asyncio.ensure_future(hold_shared(rig, [0], release, held))
    await held.wait()
    owner = rig.start(make_record(devices=[0]))  # no per_gpu: measured alone
    assert await asyncio.wait_for(owner.answered, 5) is None  # answered while it waits
    assert owner.view.phase is Phase.ACTIVATING and rig.launcher.spawned == []
    await rig.until(lambda: "StartQueued" in owner.view.conditions, "queued")
    assert [e.message for e in rig.events if e.reason == "StartQueued"] == [
        "waiting for its turn on GPU 0: it declared no per_gpu footprint, so it is measured "
        "alone once the 1 start(s) there are done"]
    release.set()
    await other
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "started in its turn")
    assert "StartQueued" not in owner.view.conditions


async def hold_shared(rig: OwnerRig, devices: list[int], release: asyncio.Event,
                      held: asyncio.Event) -> None:
    async with rig.memory.gate.turn(devices, shared=True):
        held.set()
        await release.wait()


# ---- the weight cache -----------------------------------------------------------------------


async def test_an_engine_waits_for_the_weight_cache_and_starts_on_its_copy(
        rig: OwnerRig) -> None:
    stager = FakeStager()
    rig.deps = replace(rig.deps, stager=stager)  # type: ignore[arg-type]
    stager.progress.done = 400
    owner = rig.start()
    await rig.until(lambda: "Staging" in owner.view.conditions, "staging")
    assert owner.view.staging is not None
    assert owner.view.staging.as_dict() == {"artifact_id": "entry-1", "artifact_url": "hf://org/m",
                                            "bytes_done": 400, "bytes_total": 1000}
    assert [e.message for e in rig.events if e.reason == "Staging"] == [
        "waiting for hf://org/m in the weight cache"]
    assert owner.view.phase is Phase.ACTIVATING and rig.launcher.spawned == []
    stager.staged.set()
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "started")
    assert rig.launcher.argv == [["fake-engine", "/cache/entry"]]  # the cache's copy
    assert owner.view.staging is None and "Staging" not in owner.view.conditions
    assert transitions(rig, "booting") == [("activating", "activated", "pid 4001 on port 20000")]


async def test_an_engine_whose_artifact_is_cached_starts_on_the_copy_at_once(
        rig: OwnerRig) -> None:
    stager = FakeStager()
    stager.cached["hf://org/m"] = "/cache/ready"
    rig.deps = replace(rig.deps, stager=stager)  # type: ignore[arg-type]
    owner = rig.start()
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    assert rig.launcher.argv == [["fake-engine", "/cache/ready"]]
    assert "Staging" not in rig.reasons()


async def test_an_engine_whose_staging_fails_fails_and_says_why(rig: OwnerRig) -> None:
    stager = FakeStager()
    stager.error = "s3 answered 403"
    stager.staged.set()
    rig.deps = replace(rig.deps, stager=stager)  # type: ignore[arg-type]
    owner = rig.start()
    said = "staging hf://org/m failed: s3 answered 403"
    assert await asyncio.wait_for(owner.spawned, 5) == said
    assert owner.view.phase is Phase.FAILED and owner.view.last_error == said
    assert transitions(rig, "failed") == [("activating", "StagingFailed", said)]
    assert rig.launcher.spawned == []


async def test_an_activation_whose_weights_are_still_staging_is_answered_while_it_waits(
        rig: OwnerRig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(life, "STAGING_ANSWER_S", 0.05)  # 2 s in the product
    stager = FakeStager()  # its staging does not end in this test
    rig.deps = replace(rig.deps, stager=stager)  # type: ignore[arg-type]
    owner = rig.start()
    assert await asyncio.wait_for(owner.answered, 5) is None  # `activating`, with Staging
    assert not owner.spawned.done() and rig.launcher.spawned == []
    assert owner.view.phase is Phase.ACTIVATING and "Staging" in owner.view.conditions


async def test_a_start_holds_its_cards_turn_under_its_own_name(rig: OwnerRig) -> None:
    rig.driver.healthy_answer = False  # booting: the turn is held until it answers
    owner = rig.start(make_record(devices=[0]))
    await rig.until(lambda: owner.view.phase is Phase.BOOTING, "booting")
    assert rig.memory.gate.holders([0]) == [("m1", True)]  # what a queued start names
    rig.driver.healthy_answer = True
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    assert rig.memory.gate.holders([0]) == []
