"""The durable engine registry: atomic saves, quarantine of bad files, exact round trips."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from contract.phases import Phase
from registry.record import MAX_OPERATIONS, ClaimRef, EngineRecord, EngineSpec
from registry.store import LoadResult, RegistryStore, validate_engine_id


def make_record(engine_id: str = "abcdef12", **fields: Any) -> EngineRecord:
    spec = EngineSpec(model_name="m", artifact_url="hf://org/m", ipc_name=f"kv-{engine_id}")
    return EngineRecord(engine_id=engine_id, spec=spec, port=8000, **fields)


def engine_files(store: RegistryStore) -> list[str]:
    return sorted(os.listdir(store.engines_dir))


def corrupt_files(store: RegistryStore) -> list[str]:
    return sorted(os.listdir(store.corrupt_dir)) if store.corrupt_dir.exists() else []


@pytest.fixture
def store(tmp_path: Path) -> RegistryStore:
    return RegistryStore(tmp_path / "state")


def test_a_saved_record_loads_back_equal(store: RegistryStore) -> None:
    record = make_record(pid=1234, pid_start_time=99, phase="active", created_at=5.5)
    record.remember_operation("op-1", {"status": "ok", "code": 200})
    store.save(record)
    assert store.load_all() == LoadResult(records=[record], quarantined=[])
    assert engine_files(store) == ["abcdef12.json"]


def test_saving_again_replaces_the_record(store: RegistryStore) -> None:
    store.save(make_record(phase="activating"))
    store.save(make_record(phase="active"))
    assert [r.phase for r in store.load_all().records] == [Phase.ACTIVE]
    assert engine_files(store) == ["abcdef12.json"]


def test_an_empty_state_dir_is_created_and_loads_nothing(tmp_path: Path) -> None:
    store = RegistryStore(tmp_path / "does" / "not" / "exist")
    assert store.load_all() == LoadResult(records=[], quarantined=[])
    assert store.engines_dir.is_dir()


def test_the_state_directories_are_private(store: RegistryStore) -> None:
    store.save(make_record())
    assert store.engines_dir.stat().st_mode & 0o777 == 0o700
    assert store.path_for("abcdef12").stat().st_mode & 0o077 == 0


def test_records_load_sorted_by_creation_time_then_engine_id(store: RegistryStore) -> None:
    for engine_id, created_at in [("cccccccc", 1.0), ("bbbbbbbb", 2.0), ("aaaaaaaa", 2.0)]:
        store.save(make_record(engine_id, created_at=created_at))
    assert [r.engine_id for r in store.load_all().records] == ["cccccccc", "aaaaaaaa", "bbbbbbbb"]


def test_delete_removes_the_record_and_tolerates_a_missing_one(store: RegistryStore) -> None:
    store.save(make_record("aaaaaaaa"))
    store.save(make_record("bbbbbbbb"))
    store.delete("aaaaaaaa")
    store.delete("aaaaaaaa")
    store.delete("cccccccc")
    assert [r.engine_id for r in store.load_all().records] == ["bbbbbbbb"]


def test_delete_before_anything_was_saved_is_fine(store: RegistryStore) -> None:
    store.delete("abcdef12")


@pytest.mark.parametrize(
    "engine_id",
    [
        "",
        "abc",
        "ABCDEF12",
        "abcdefg1",
        "../../etc",
        "abcdef12/..",
        "a" * 65,
        "abcdef12\n",
        " abcdef12",
    ],
)
def test_a_bad_engine_id_is_rejected_everywhere(store: RegistryStore, engine_id: str) -> None:
    with pytest.raises(ValueError):
        validate_engine_id(engine_id)
    with pytest.raises(ValueError):
        store.path_for(engine_id)
    with pytest.raises(ValueError):
        store.delete(engine_id)
    record = replace(make_record(), engine_id=engine_id)
    with pytest.raises(ValueError):
        store.save(record)
    assert not store.engines_dir.exists() or engine_files(store) == []


@pytest.mark.parametrize("engine_id", ["abcdef12", "0" * 64, "0123456789abcdef"])
def test_good_engine_ids_are_accepted(engine_id: str) -> None:
    assert validate_engine_id(engine_id) == engine_id


def test_a_failed_replace_keeps_the_old_record_and_leaves_no_temp_file(
    store: RegistryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.save(make_record(phase="activating"))

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        store.save(make_record(phase="active"))
    monkeypatch.undo()
    assert engine_files(store) == ["abcdef12.json"]
    assert [r.phase for r in store.load_all().records] == ["activating"]


def test_a_failed_temp_write_keeps_the_old_record(
    store: RegistryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.save(make_record(phase="activating"))

    def broken_fsync(fd: int) -> None:
        raise OSError("EIO")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="EIO"):
        store.save(make_record(phase="active"))
    monkeypatch.undo()
    assert engine_files(store) == ["abcdef12.json"]
    assert [r.phase for r in store.load_all().records] == ["activating"]


def test_save_fsyncs_the_file_before_the_rename_and_the_directory_after(
    store: RegistryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.save(make_record("aaaaaaaa"))  # directories exist from here on
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store.save(make_record("bbbbbbbb"))
    assert events == ["fsync-file", "replace", "fsync-dir"]


def test_stray_temp_files_from_a_crashed_save_are_removed(store: RegistryStore) -> None:
    store.save(make_record())
    stray = store.engines_dir / ".abcdef12.x1y2z3.tmp"
    stray.write_bytes(b'{"version": 1, "engine_id": "abc')
    result = store.load_all()
    assert [r.engine_id for r in result.records] == ["abcdef12"]
    assert result.quarantined == []
    assert engine_files(store) == ["abcdef12.json"]


def test_unrelated_files_are_left_alone(store: RegistryStore) -> None:
    store.save(make_record())
    (store.engines_dir / "README").write_text("notes")
    assert len(store.load_all().records) == 1
    assert engine_files(store) == ["README", "abcdef12.json"]


def _valid_json(engine_id: str) -> bytes:
    return msgspec.json.encode(make_record(engine_id))


BAD_CONTENT: dict[str, tuple[bytes, str]] = {
    "truncated": (_valid_json("bbbbbbbb")[: len(_valid_json("bbbbbbbb")) // 2], "not valid JSON"),
    "empty": (b"", "empty file"),
    "whitespace": (b"  \n", "empty file"),
    "not json": (b"hello, world", "not valid JSON"),
    "not utf-8": (b"\xff\xfe\x00garbage", "not valid JSON"),
    "a json list": (b"[1, 2, 3]", "invalid record"),
    "missing fields": (json.dumps({"engine_id": "bbbbbbbb"}).encode(), "invalid record"),
    "wrong type": (
        json.dumps({**json.loads(_valid_json("bbbbbbbb")), "port": "eighty"}).encode(),
        "invalid record",
    ),
    "bad literal": (
        json.dumps({**json.loads(_valid_json("bbbbbbbb")), "desired": "dreaming"}).encode(),
        "invalid record",
    ),
    "nested too deep": (  # a free-form field (operations) nested past the decoder's bound
        _valid_json("bbbbbbbb")[:-1] + b',"operations":{"x":{"y":' + b"[" * 100_000
        + b"]" * 100_000 + b"}}}",
        "invalid record",
    ),
    "mismatched engine id": (_valid_json("cccccccc"), "does not match file name"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONTENT))
def test_a_bad_record_file_is_quarantined_and_the_others_still_load(
    store: RegistryStore, case: str
) -> None:
    content, reason = BAD_CONTENT[case]
    store.save(make_record("aaaaaaaa"))
    store.save(make_record("dddddddd"))
    bad = store.engines_dir / "bbbbbbbb.json"
    bad.write_bytes(content)

    result = store.load_all()

    assert [r.engine_id for r in result.records] == ["aaaaaaaa", "dddddddd"]
    assert len(result.quarantined) == 1
    q = result.quarantined[0]
    assert q.original == bad
    assert reason in q.reason
    assert q.kept_at.parent == store.corrupt_dir
    assert q.kept_at.name.startswith("bbbbbbbb.json.")
    assert int(q.kept_at.name.rsplit(".", 1)[1]) > 0
    assert q.kept_at.read_bytes() == content, "the bad file is kept for inspection, unchanged"
    assert not bad.exists()
    assert engine_files(store) == ["aaaaaaaa.json", "dddddddd.json"]
    assert store.load_all().quarantined == [], "a quarantined file is not reported twice"


def test_a_bad_file_that_cannot_be_moved_aside_is_still_reported_without_raising(
    store: RegistryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.save(make_record("aaaaaaaa"))
    (store.engines_dir / "bbbbbbbb.json").write_bytes(b"{")

    def broken_replace(src: Any, dst: Any) -> None:
        raise PermissionError("read-only")

    monkeypatch.setattr(os, "replace", broken_replace)
    result = store.load_all()
    assert [r.engine_id for r in result.records] == ["aaaaaaaa"]
    [q] = result.quarantined
    assert q.kept_at == q.original == store.engines_dir / "bbbbbbbb.json"
    assert "not valid JSON" in q.reason and "could not move" in q.reason


def test_a_json_file_whose_name_is_not_an_engine_id_is_quarantined(store: RegistryStore) -> None:
    (store.engines_dir).mkdir(parents=True)
    (store.engines_dir / "Not-An-Id.json").write_bytes(_valid_json("abcdef12"))
    result = store.load_all()
    assert result.records == []
    assert [q.reason for q in result.quarantined] == ["file name is not a valid engine id"]
    assert corrupt_files(store)[0].startswith("Not-An-Id.json.")


def test_a_directory_named_like_a_record_is_quarantined(store: RegistryStore) -> None:
    (store.engines_dir / "abcdef12.json").mkdir(parents=True)
    result = store.load_all()
    assert result.records == []
    assert [q.reason for q in result.quarantined] == ["not a regular file"]
    assert engine_files(store) == []


def test_several_bad_files_are_all_quarantined(store: RegistryStore) -> None:
    store.save(make_record("aaaaaaaa"))
    for engine_id, (content, _) in zip(["bbbbbbbb", "cccccccc", "dddddddd"], BAD_CONTENT.values()):
        (store.engines_dir / f"{engine_id}.json").write_bytes(content)
    result = store.load_all()
    assert [r.engine_id for r in result.records] == ["aaaaaaaa"]
    assert sorted(q.original.name for q in result.quarantined) == [
        "bbbbbbbb.json",
        "cccccccc.json",
        "dddddddd.json",
    ]
    assert len(corrupt_files(store)) == 3


def test_a_record_written_by_a_newer_agent_with_extra_fields_still_loads(
    store: RegistryStore,
) -> None:
    data = {**json.loads(_valid_json("abcdef12")), "future_field": {"x": 1}}
    store.engines_dir.mkdir(parents=True)
    (store.engines_dir / "abcdef12.json").write_text(json.dumps(data))
    assert [r.engine_id for r in store.load_all().records] == ["abcdef12"]


# --- property: any record round-trips exactly ------------------------------------------------

text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=20)
finite = st.floats(allow_nan=False, allow_infinity=False)
small_int = st.integers(min_value=-(2**63), max_value=2**63 - 1)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | finite | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
specs = st.builds(
    EngineSpec,
    model_name=text,
    artifact_url=text,
    engine=st.sampled_from(["vllm", "ollama", "sim"]),
    ipc_name=text,
    args=st.dictionaries(text, text, max_size=4),
    claim_ref=st.none() | st.builds(ClaimRef, namespace=text, name=text, uid=text),
)
records = st.builds(
    EngineRecord,
    version=small_int,
    engine_id=st.from_regex(r"[a-f0-9]{8,64}", fullmatch=True),
    spec=specs,
    port=small_int,
    desired=st.sampled_from(["awake", "asleep"]),
    sleep_level=st.none() | small_int,
    pid=st.none() | small_int,
    pid_start_time=st.none() | small_int,
    phase=st.sampled_from(list(Phase)),
    restart_count=small_int,
    last_error=st.none() | text,
    last_transition=finite,
    created_at=finite,
    operations=st.dictionaries(
        text, st.dictionaries(text, json_value, max_size=3), max_size=MAX_OPERATIONS // 8
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=records)
def test_any_record_saved_then_loaded_compares_equal(record: EngineRecord) -> None:
    with tempfile.TemporaryDirectory() as state_dir:
        store = RegistryStore(Path(state_dir))
        store.save(record)
        result = store.load_all()
    assert result.quarantined == []
    assert result.records == [record]
    assert msgspec.to_builtins(result.records[0]) == msgspec.to_builtins(record)


def test_a_record_with_a_phase_the_code_does_not_know_is_quarantined(tmp_path: Path) -> None:
    store = RegistryStore(tmp_path)
    store.save(make_record(phase="active"))
    path = store.path_for(make_record().engine_id)
    data = json.loads(path.read_text())
    data["phase"] = "hibernating"  # written by a newer agent, or by hand
    path.write_text(json.dumps(data))
    loaded = store.load_all()
    assert loaded.records == [] and len(loaded.quarantined) == 1
    assert "phase" in loaded.quarantined[0].reason


# ---- saves of what the file already holds (issue 26) -------------------------------------------


def _fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_saving_a_loaded_record_unchanged_writes_nothing(
        store: RegistryStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store.save(make_record(pid=1234, pid_start_time=99, phase="active"))
    again = RegistryStore(tmp_path / "state")  # a restarted agent's store
    (record,) = again.load_all().records
    before = os.stat(again.path_for(record.engine_id))
    fsyncs = _fsyncs(monkeypatch)
    again.save(record)
    after = os.stat(again.path_for(record.engine_id))
    assert fsyncs == [] and (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_changed_record_is_written_whatever_was_loaded(
        store: RegistryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store.save(make_record(phase="active"))
    (record,) = store.load_all().records
    record.restart_count = 1
    fsyncs = _fsyncs(monkeypatch)
    store.save(record)
    assert len(fsyncs) == 2  # the file and its directory
    assert [r.restart_count for r in RegistryStore(store.state_dir).load_all().records] == [1]


def test_a_save_that_failed_is_made_again_in_full(
        store: RegistryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store.save(make_record(phase="activating"))
    active = make_record(phase="active")

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "EIO")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="EIO"):
        store.save(active)
    monkeypatch.undo()
    store.save(active)  # not taken for what the file holds
    assert [r.phase for r in RegistryStore(store.state_dir).load_all().records] == ["active"]


def test_a_deleted_record_saved_again_is_written_again(store: RegistryStore) -> None:
    record = make_record(phase="active")
    store.save(record)
    store.delete(record.engine_id)
    store.save(record)
    assert RegistryStore(store.state_dir).load_all().records == [record]


# A record exactly as the agent wrote it while records were pydantic models (f6d8a23's
# EngineRecord.model_dump_json(), every field set): an upgraded agent reads it whole, and
# writes the same bytes back, so an upgrade neither quarantines nor rewrites a running fleet.
PYDANTIC_ERA_RECORD = (
    '{"version":1,"engine_id":"0123abcd","spec":{"model_name":"qwen3","artifact_url":"hugging'
    'face://Qwen/Qwen3-0.6B","engine":"vllm","ipc_name":"kvc_qwen3","args":{"--max-model-len"'
    ':"4096","--enforce-eager":""},"claim_ref":{"namespace":"default","name":"qwen3","uid":"u'
    '-1"}},"port":20007,"desired":"asleep","sleep_level":1,"pid":4242,"pid_start_time":123456'
    ',"phase":"sleeping","restart_count":2,"last_error":null,"last_exit":"exited with code 1"'
    ',"last_transition":1764700000.5,"created_at":1764690000.25,"hbm_peak_bytes":7516192768,"'
    'hbm_peak_pid":4243,"operations":{"op-1":{"action":"sleep"}},"devices":[0,1],"per_gpu":{"'
    'maximum_footprint_bytes":6442450944,"kv_floor_bytes":1073741824},"kv_limit_bytes":214748'
    '3648,"kv_capacity_bytes":4294967296,"kv_inode":77,"kv_applied_bytes":2147483648,"kv_owne'
    'r_inode":78,"op_counts":{"sleep:success":3},"budget_exhausted":0,"credentials":{"HF_TOKE'
    'N":"hf_x"},"operation":{"action":"wake","level":1,"started_at":1764700001.0},"healthy_si'
    'nce":1764695000.0,"adapters":[{"name":"sql","path":"/models/sql","artifact_url":null}]}'
)


def test_a_record_written_by_the_pydantic_era_agent_is_read_whole_and_written_back_the_same(
        tmp_path: Path) -> None:
    store = RegistryStore(tmp_path)
    store.engines_dir.mkdir(parents=True)
    (store.engines_dir / "0123abcd.json").write_text(PYDANTIC_ERA_RECORD)
    result = store.load_all()
    assert result.quarantined == []
    (record,) = result.records
    assert msgspec.to_builtins(record) == json.loads(PYDANTIC_ERA_RECORD)
    assert record.phase is Phase.SLEEPING and record.spec.claim_ref == ClaimRef(
        namespace="default", name="qwen3", uid="u-1")
    assert record.per_gpu is not None and record.per_gpu.need_bytes == 7 * 2**30
    assert msgspec.json.encode(record) == PYDANTIC_ERA_RECORD.encode()


@pytest.mark.parametrize("carried", [
    "",  # nothing carried
    "[" * 100_000 + "]" * 100_000,  # nested past json's bound
    json.dumps({"spec": {"model_name": "m", "artifact_url": "x", "ipc_name": "k",
                         "args": {"a": [[[[]]]]}}, "port": 20001}),  # args must be strings
    json.dumps({"spec": {"model_name": "m", "artifact_url": "x", "ipc_name": "k"},
                "port": 20001, "per_gpu": {"maximum_footprint_bytes": 0,
                                           "kv_floor_bytes": 1}}),  # a bound broken
])
def test_a_record_is_not_rebuilt_from_an_environment_it_cannot_validate(carried: str) -> None:
    """A running engine whose record was lost is rebuilt from the spec it carries; what it
    carries is validated as a record read from disk is, and a bad one rebuilds nothing."""
    from registry.env import ENV_ENGINE_ID, ENV_ENGINE_SPEC
    from registry.identity import FoundEngine
    from runtime_agent.supervision.recovery import record_from_process

    found = FoundEngine(pid=4242, start_time=1, pgid=4242,
                        environ={ENV_ENGINE_ID: "bbbbbbbb", ENV_ENGINE_SPEC: carried})
    assert record_from_process(found, 1.0) is None
    good = json.dumps({"spec": {"model_name": "m", "artifact_url": "x", "ipc_name": "k"},
                       "port": 20001, "per_gpu": {"maximum_footprint_bytes": 2,
                                                  "kv_floor_bytes": 1}})
    rebuilt = record_from_process(
        FoundEngine(pid=4242, start_time=1, pgid=4242,
                    environ={ENV_ENGINE_ID: "bbbbbbbb", ENV_ENGINE_SPEC: good}), 1.0)
    assert rebuilt is not None and rebuilt.per_gpu is not None
    assert rebuilt.per_gpu.need_bytes == 3 and rebuilt.phase is Phase.BOOTING
