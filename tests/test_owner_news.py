"""What an engine owner does with its engine's news, tested directly over the recording fakes.

The helpers of a running engine post what they learn to its owner's inbox: request figures,
KV-segment readings, the LoRA adapters loaded after a start or on request. Each must reach the
engine's view and record; a KV reading taken before the agent's own write must not undo it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.phases import Phase
from engines.driver import Observation
from registry.record import EngineRecord, EngineSpec, LoraAdapter
from runtime_agent.kv.segment import create_segment, read_segment
from runtime_agent.cadence import Pacer
from runtime_agent.supervision.messages import (
    Figures,
    KvReading,
    LoadAdapter,
    Revive,
    SetKvLimit,
    Sleep,
    Wake,
)
from runtime_agent.supervision.owner import loop as owner_loop
from runtime_agent.supervision.outcomes import Done
from tests.owner_fakes import OwnerRig, fast_settings

pytestmark = pytest.mark.loop_guard  # the in-process core must not block its loop

GIB = 1 << 30


@pytest.fixture
async def rig(tmp_path: Path):
    rig = OwnerRig(tmp_path, fast_settings(tmp_path))
    yield rig
    await rig.close()


async def test_request_figures_reach_the_view_with_when_they_were_taken(rig: OwnerRig) -> None:
    rig.clock.wall_at = 1234.5
    rig.driver.figures = Observation(running=3, waiting=1, success_total=42)
    owner = rig.start()
    await rig.until(lambda: owner.view.requests_running is not None, "figures")
    view = owner.view
    assert (view.requests_running, view.requests_waiting, view.request_success_total,
            view.figures_at) == (3, 1, 42, 1234.5)


async def test_the_kv_segment_is_read_recorded_and_a_reading_older_than_a_write_is_dropped(
        rig: OwnerRig) -> None:
    owner = rig.start()
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    create_segment("kvc_m1", 4 * GIB, rig.settings.kv_shm_dir)  # the engine makes its segment
    before = read_segment("kvc_m1", rig.settings.kv_shm_dir)
    await rig.until(lambda: owner.view.kv.capacity == 4 * GIB, "the segment read")
    await rig.until(lambda: next(iter(rig.store.records.values())).kv_capacity_bytes == 4 * GIB,
                    "its capacity recorded (re-adoption needs it)")
    limited = await rig.ask(SetKvLimit(GIB))
    assert isinstance(limited, Done) and limited.details["in_force"] is True
    assert owner.view.kv.applied == GIB
    # a reading the watcher took just before that write: it must not pass for someone
    # else's write of the old size, to be "set back"
    owner.post(KvReading(owner.generation, before, owner.kv.writes - 1))
    await rig.ask(Revive())  # answered after the reading was handled
    assert owner.view.kv.set_back_total == 0 and "KVLimitSetBack" not in rig.reasons()
    assert read_segment("kvc_m1", rig.settings.kv_shm_dir).total_size == GIB  # type: ignore[union-attr]


def lora_record(*adapters: LoraAdapter) -> EngineRecord:
    spec = EngineSpec(model_name="m1", artifact_url="hf://org/m", engine="vllm",
                      ipc_name="kvc_m1", args={"--enable-lora": ""})
    return EngineRecord(engine_id="e" * 16, spec=spec, port=20000, created_at=1.0,
                        last_transition=1.0, adapters=list(adapters))


async def test_a_started_engine_gets_its_recorded_adapters_and_loads_new_ones(
        rig: OwnerRig) -> None:
    owner = rig.start(lora_record(LoraAdapter(name="sql", path="/a/sql")))
    await rig.until(lambda: owner.view.adapters == (("sql", "/a/sql", True),), "sql loaded")
    assert "load_adapter:sql" in rig.driver.calls
    loaded = await rig.ask(LoadAdapter("chat", "/a/chat"))
    assert isinstance(loaded, Done) and loaded.details == {
        "lora_name": "chat", "loaded": True, "adapters": ["chat", "sql"]}
    assert owner.view.adapters == (("sql", "/a/sql", True), ("chat", "/a/chat", True))
    assert [e.message for e in rig.events if e.reason == "AdapterLoaded"] == ["chat"]


# ---- what counts as a change: the watchers' pace ---------------------------------------------


class CountingPacer(Pacer):
    """A watcher's pace that counts the owner's nudges (each change nudges all three)."""

    nudges: list[None] = []

    def nudge(self) -> None:
        CountingPacer.nudges.append(None)
        super().nudge()


@pytest.fixture
def nudges(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    monkeypatch.setattr(owner_loop, "Pacer", CountingPacer)
    CountingPacer.nudges = []
    return CountingPacer.nudges


PACES = 3  # the health probe's, the scrape's and the KV check's


async def nudged_by(rig: OwnerRig, nudges: list[None], message: object) -> int:
    """How many nudges the owner gives its paces for ``message``. An intent asked after it
    is answered once the message was handled (the inbox is served in order); the intent
    nudges every pace itself (an API call brings the watchers back), which is subtracted."""
    assert rig.owner is not None
    before = len(nudges)
    rig.owner.post(message)  # type: ignore[arg-type]
    assert isinstance(await rig.ask(Wake()), Done)
    return len(nudges) - before - PACES


async def test_new_request_figures_bring_the_watchers_back_to_their_fast_pace_and_the_same_do_not(
        rig: OwnerRig, nudges: list[None]) -> None:
    owner = rig.start()
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    busy = Observation(running=2, waiting=1, success_total=5)
    rig.driver.figures = busy  # the scrape's own reading, if one comes, says the same
    assert await nudged_by(rig, nudges, Figures(owner.generation, busy)) >= PACES
    assert owner.view.requests_running == 2
    assert await nudged_by(rig, nudges, Figures(owner.generation, busy)) == 0  # said again
    done = Observation(running=0, waiting=0, success_total=7)
    rig.driver.figures = done
    assert await nudged_by(rig, nudges, Figures(owner.generation, done)) >= PACES
    assert owner.view.requests_running == 0


async def test_a_kv_reading_that_moved_brings_the_watchers_back_and_one_that_did_not_does_not(
        rig: OwnerRig, nudges: list[None]) -> None:
    owner = rig.start()
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    create_segment("kvc_m1", 4 * GIB, rig.settings.kv_shm_dir)
    await rig.until(lambda: owner.view.kv.capacity == 4 * GIB, "the segment read")
    seen = read_segment("kvc_m1", rig.settings.kv_shm_dir)
    same = KvReading(owner.generation, seen, owner.kv.writes)
    assert await nudged_by(rig, nudges, same) == 0  # nothing moved
    gone = KvReading(owner.generation, None, owner.kv.writes)
    assert await nudged_by(rig, nudges, gone) >= PACES  # the segment is gone (and told)
    assert "KVSegmentMissing" in owner.view.conditions


async def test_the_engines_own_word_on_its_sleep_level_is_recorded(rig: OwnerRig) -> None:
    owner = rig.start()
    await rig.until(lambda: owner.view.phase is Phase.ACTIVE, "active")
    assert isinstance(await rig.ask(Sleep(2)), Done)
    assert owner.view.sleep_level == 2
    owner.post(Figures(owner.generation, Observation(running=0, waiting=0, success_total=0,
                                                     sleep_level=1)))
    assert isinstance(await rig.ask(Sleep(1)), Done)  # answered after the figures were handled
    assert owner.view.sleep_level == 1  # vLLM's engine_sleep_state beats the record's guess
    assert next(iter(rig.store.records.values())).sleep_level == 1  # and it is durable
