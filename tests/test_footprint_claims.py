"""A claim without perGPU in a claims directory: placed on its artifact's estimate (marked as
estimated) when the artifact is a readable model directory; held InvalidPerGPU, saying why,
when it is not. The real reconciler over the claims directory, against a fake agent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from contract.footprint.reading import estimate_directory
from tests.reconciler_fakes import FakeAgent, Rig, claim_yaml
from tests.test_footprint import QWEN3_06B, model_dir

pytestmark = [pytest.mark.timeout(30)]


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
