"""A claim without perGPU in a claims directory: placed on its artifact's estimate (marked as
estimated) when the artifact is a readable model directory; placed to be measured, on a card of
its own, when it is not. The real reconciler over the claims directory, against fake agents."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from contract.footprint.reading import estimate_directory
from reconciler.claims import MEASURE_WAIT_S, MEASURED_RECHECK_S
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


async def test_without_per_gpu_an_unreadable_artifact_is_placed_to_be_measured_alone(
        tmp_path: Path) -> None:
    """Not Pending for want of figures (the seed says InvalidPerGPU): placed on a card of its
    own, started with no perGPU and no KV limit, and that card holds nothing else meanwhile."""
    a, b = FakeAgent("agent-a"), FakeAgent("agent-b")
    rig = Rig(claims_dir(tmp_path), [a, b],
              without_per_gpu(claim_yaml("remote")) + without_per_gpu(claim_yaml(
                  "empty", artifact=f"file://{tmp_path / 'nothing'}"))
              + without_per_gpu(claim_yaml("third")) + claim_yaml("declared"))
    for name, where in (("remote", a), ("empty", b)):
        await rig.reconcile(name)
        st = rig.status(name)
        assert (st.phase, st.reason("Scheduled")) == ("Activating", "Placed")
        assert st.conditions["Scheduled"].message.endswith("to be measured there")
        (_, spec), = where.calls_of("activate")
        assert "per_gpu" not in spec.body() and "kv_limit_bytes" not in spec.body()
    for name in ("third", "declared"):
        await rig.reconcile(name)
        assert rig.status(name).phase == "Pending"
    third = rig.status("third").conditions["Scheduled"].message
    assert "not a local directory" in third and "agent-a: GPU 0 runs remote" in third
    assert len(a.calls_of("activate")) == len(b.calls_of("activate")) == 1


async def test_a_claim_placed_to_be_measured_takes_its_measurement_before_the_route(
        tmp_path: Path) -> None:
    """Measured once ready (peak HBM less KV in use), recorded, given a KV limit by its new
    figures (the KV floor assumed: no config to read), then Active; its card takes others."""
    a = FakeAgent("agent-a")
    book = tmp_path / "state" / FILE_NAME
    book.parent.mkdir()
    rig = Rig(claims_dir(tmp_path), [a], without_per_gpu(claim_yaml("remote"))
              + claim_yaml("declared"), footprints=book)
    await rig.reconcile("remote")
    a.set("remote", phase="active", ready=True, hbm_peak_bytes=3 * GiB + 5, kv_used_bytes=GiB)
    assert (await rig.reconcile("remote")).requeue_after == MEASURED_RECHECK_S
    st = rig.status("remote")
    assert (st.phase, st.reason("Ready")) == ("Activating", "EngineStarting")
    assert "measured on agent-a" in st.conditions["Ready"].message and rig.kv_kicks
    await rig.kv.reconcile("agent-a")
    (_, model, limit), = a.calls_of("kv_limit")
    assert model == "remote" and limit >= GiB
    await rig.reconcile("remote")
    st = rig.status("remote")
    assert st.phase == "Active"
    shown = st.as_json()["spec"]["perGPU"]
    assert (shown["maximumFootprint"], shown["kvFloor"]) == (2 * GiB + MiB, GiB)
    assert "KV floor assumed 1.0 GiB" in shown["estimated"]
    assert FootprintBook(book).lookup("huggingface://t/remote", {"--max-model-len": "2048"})
    await rig.reconcile("declared")  # 15 GiB usable, 3 GiB held by remote: 7 GiB fits
    assert rig.status("declared").phase == "Activating"


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


async def test_a_ready_engine_waits_off_the_route_for_its_first_gpu_sample_then_not_forever(
        tmp_path: Path) -> None:
    """Ready before its agent's first GPU sample of it: Activating, not Active and then
    Activating again once measured; an agent with no sample of it within MEASURE_WAIT_S lets
    it serve unmeasured, and a front-door release never puts it to sleep (its wake could not
    count its room)."""
    a = FakeAgent("agent-a")
    rig = Rig(claims_dir(tmp_path), [a], without_per_gpu(claim_yaml("remote")))
    await rig.reconcile("remote")
    a.set("remote", phase="active", ready=True, hbm_peak_bytes=None, kv_used_bytes=GiB)
    for _ in range(3):
        await rig.reconcile("remote", advance=1.0)
        st = rig.status("remote")
        assert st.phase == "Activating" and "waits to be measured" in \
            st.conditions["Ready"].message
    await rig.reconcile("remote", advance=MEASURE_WAIT_S)
    assert rig.status("remote").phase == "Active"
    assert rig.status("remote").as_json()["spec"].get("perGPU") is None
    rig.deps.books.releases.ask("remote", rig.clock.now())
    await rig.reconcile("remote")
    release = rig.deps.books.releases.get("remote")
    assert release is not None and release.error is not None and "not measured" in release.error
    assert a.calls_of("sleep") == []


async def test_an_edit_kept_back_keeps_the_running_versions_own_measurement(
        tmp_path: Path) -> None:
    """An immutable edit (new engine arguments) keeps the running version, and its figures
    stay the running arguments': measured under them, the running claim carries them."""
    a = FakeAgent("agent-a")
    text = without_per_gpu(claim_yaml("remote"))
    rig = Rig(claims_dir(tmp_path), [a], text)
    await rig.reconcile("remote")
    rig.write_claims(text.replace('"--max-model-len": "2048"', '"--max-model-len": "4096"'))
    a.set("remote", phase="active", ready=True, hbm_peak_bytes=3 * GiB, kv_used_bytes=GiB)
    assert (await rig.reconcile("remote")).requeue_after == MEASURED_RECHECK_S
    running = rig.desired.claim(("default", "remote"))
    assert running is not None and running.engine_args["--max-model-len"] == "2048"
    assert running.per_gpu is not None and running.per_gpu.maximum_footprint == 2 * GiB
