"""A claim without perGPU in a claims directory: placed on its artifact's estimate (marked as
estimated) when the artifact is a readable model directory; held InvalidPerGPU, saying why,
when it is not. The real reconciler over the claims directory, against a fake agent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from contract.footprint.reading import estimate_directory
from reconciler.claims import MEASURED_RECHECK_S
from reconciler.footprints import FILE_NAME, FootprintBook, Measured
from tests.reconciler_fakes import FakeAgent, Rig, claim_yaml
from tests.test_footprint import QWEN3_06B, model_dir

pytestmark = [pytest.mark.timeout(30)]
GiB, MiB = 1 << 30, 1 << 20


def claims_dir(root: Path) -> Path:
    (root / "claims").mkdir()
    return root / "claims"


def without_per_gpu(text: str) -> str:
    return re.sub(r"  perGPU:\n    maximumFootprint: \S+\n    kvFloor: \S+\n", "", text)


async def test_a_claim_without_per_gpu_is_placed_on_its_local_artifacts_estimate(
        tmp_path: Path) -> None:
    model = model_dir(tmp_path / "model", QWEN3_06B, {"w": ("BF16", [1024, 1024], 2)})
    want = estimate_directory(model, {"--max-model-len": "2048"})
    a = FakeAgent("agent-a")
    rig = Rig(claims_dir(tmp_path), [a], without_per_gpu(claim_yaml(
        "local", artifact=f"file://{model}")))
    await rig.reconcile("local")
    (_, spec), = a.calls_of("activate")
    assert (spec.maximum_footprint_bytes, spec.kv_floor_bytes) == (want.footprint.bytes,
                                                                   want.kv_floor.bytes)
    st = rig.status("local")
    assert (st.phase, st.reason("Scheduled")) == ("Activating", "Placed")
    shown = st.as_json()["spec"]["perGPU"]
    assert shown["kvFloor"] == 224 << 20 and shown["estimated"].startswith("estimated from")


async def test_a_declared_per_gpu_still_wins_over_the_estimate(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "model", QWEN3_06B, {"w": ("BF16", [1024, 1024], 2)})
    a = FakeAgent("agent-a")
    rig = Rig(claims_dir(tmp_path), [a], claim_yaml("local", artifact=f"file://{model}"))
    await rig.reconcile("local")
    (_, spec), = a.calls_of("activate")
    assert (spec.maximum_footprint_bytes, spec.kv_floor_bytes) == (6 << 30, 1 << 30)
    assert "estimated" not in rig.status("local").as_json()["spec"]["perGPU"]


async def test_without_per_gpu_an_unreadable_artifact_is_held_invalid_per_gpu_saying_why(
        tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(claims_dir(tmp_path), [a],
              without_per_gpu(claim_yaml("remote")) + without_per_gpu(claim_yaml(
                  "empty", artifact=f"file://{tmp_path / 'nothing'}")))
    for name, why in (("remote", "not a local directory"), ("empty", "not a directory")):
        await rig.reconcile(name)
        st = rig.status(name)
        assert (st.phase, st.reason("Scheduled")) == ("Pending", "InvalidPerGPU")
        assert why in st.conditions["Scheduled"].message
    assert a.calls == []


async def test_once_its_engine_runs_the_measured_footprint_replaces_the_estimate_and_is_kept(
        tmp_path: Path) -> None:
    """The seed's recipe (peak HBM less the KV cache in use), recorded per artifact and engine
    arguments in the state directory: a reconciler started later places on it."""
    model = model_dir(tmp_path / "model", QWEN3_06B, {"w": ("BF16", [1024, 1024], 2)})
    estimate = estimate_directory(model, {"--max-model-len": "2048"})
    text = without_per_gpu(claim_yaml("local", artifact=f"file://{model}"))
    a = FakeAgent("agent-a")
    book = tmp_path / "state" / FILE_NAME
    book.parent.mkdir()
    rig = Rig(claims_dir(tmp_path), [a], text, footprints=book)
    await rig.reconcile("local")
    (model_name,) = a.models
    a.serve(model_name)
    a.set(model_name, hbm_peak_bytes=3 * GiB + 5, kv_used_bytes=GiB)
    result = await rig.reconcile("local")
    assert result.requeue_after == MEASURED_RECHECK_S
    await rig.reconcile("local")
    shown = rig.status("local").as_json()["spec"]["perGPU"]
    assert shown["maximumFootprint"] == 2 * GiB + MiB  # rounded up to a MiB
    assert shown["kvFloor"] == estimate.kv_floor.bytes
    assert shown["estimated"].startswith("measured on agent-a: peak HBM 3221225477 bytes less "
                                         "1073741824 of KV cache in use, per GPU")
    a.set(model_name, hbm_peak_bytes=2 * GiB, kv_used_bytes=GiB)  # smaller: the peak is kept
    assert (await rig.reconcile("local")).requeue_after != MEASURED_RECHECK_S
    # A reconciler started later over the same state places on the measured figure.
    other = tmp_path / "again"
    other.mkdir()
    b = FakeAgent("agent-b")
    again = Rig(claims_dir(other), [b], text, footprints=book)
    await again.reconcile("local")
    (_, spec), = b.calls_of("activate")
    assert (spec.maximum_footprint_bytes, spec.kv_floor_bytes) == (2 * GiB + MiB,
                                                                   estimate.kv_floor.bytes)


def test_an_unreadable_book_is_started_afresh_and_a_hostile_one_never_raises(
        tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    for text in ("{", "[]", '{"footprints": [{"key": 1}]}', "[" * 100000,
                 '{"footprints": [{"key": ["a", [["--x", "1"]]], "footprint": -1, "agent": "a",'
                 ' "at": 0, "peak": 0, "kv_used": 0}]}'):
        path.write_text(text)
        book = FootprintBook(path)
        assert book.get("a", {"--x": "1"}) is None
    book.observe("a", {"--x": "1"}, Measured(MiB, "agent-a", 0.0, 2 * MiB, MiB))
    assert FootprintBook(path).lookup("a", {"--x": "1"}) == (
        MiB, "measured on agent-a: peak HBM 2097152 bytes less 1048576 of KV cache in use, "
        "per GPU")
