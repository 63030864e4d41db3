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
from runtime_agent.supervision.messages import KvReading, LoadAdapter, Revive, SetKvLimit
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
