"""A failed read is never an empty one (issue 11, item 9): faults injected into the claims
directory of a reconciler driving real agents; none may stop a running model, each is reported
on the claim (condition ``SpecApplied``, a Warning event, ``claims get``)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from reconciler.cli import spec_warnings
from reconciler.status import ClaimStatus
from tests.harness import AgentProcess
from tests.test_reconciler_integration import CARD, Pool, sim_claim

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
async def pool(tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> AsyncIterator[Pool]:
    made = Pool(tmp_path, [agent_factory(restart_delays="0.05", extra_args=CARD)])
    made.write_pool()
    yield made
    if made.app is not None:
        await made.app.stop()


def spec(st: ClaimStatus | None) -> tuple[str, str] | None:
    cond = st.conditions.get("SpecApplied") if st is not None else None
    return (cond.status, cond.reason) if cond is not None else None


async def running(pool: Pool, name: str) -> str:
    """The claim is Active; its engine's id (which must not change under the faults)."""
    await pool.phase(name, "Active")
    engine = pool.engine("agent-a", f"{name}-model")
    assert engine is not None and engine["phase"] == "active"
    return str(engine["engine_id"])


async def still_running(pool: Pool, name: str, engine_id: str) -> None:
    engine = pool.engine("agent-a", f"{name}-model")
    assert engine is not None and engine["phase"] == "active", "the fault stopped the model"
    assert engine["engine_id"] == engine_id, "the fault restarted the model"
    st = pool.status(name)
    assert st is not None and st.phase == "Active" and st.deleted is None


async def test_a_yaml_typo_in_a_valid_claim_keeps_it_running_and_says_so(pool: Pool) -> None:
    pool.write("m", sim_claim("m"))
    await pool.start()
    engine_id = await running(pool, "m")
    pool.write("m", sim_claim("m").replace("spec:", "spec: [unclosed", 1))
    await pool.until("the typo reported", lambda: spec(pool.status("m")) == (
        "False", "InvalidYAML"))
    await still_running(pool, "m", engine_id)
    st = pool.status("m")
    assert st is not None and any(e.reason == "InvalidYAML" and e.type == "Warning"
                                  for e in st.events)
    listed = await pool.get("/v1/claims")
    assert any("InvalidYAML" in line for line in spec_warnings(listed["items"]))
    pool.write("m", sim_claim("m"))
    await pool.until("the fix taken", lambda: spec(pool.status("m")) == ("True", "Applied"))
    await still_running(pool, "m", engine_id)


async def test_a_claims_file_caught_empty_mid_rewrite_stops_nothing(pool: Pool) -> None:
    pool.write("m", sim_claim("m"))
    await pool.start()
    engine_id = await running(pool, "m")
    path = pool.dir / "m.yaml"
    with open(path, "w"):  # truncated, not yet written: what a non-atomic rewrite shows
        await pool.until("the empty file reported", lambda: spec(pool.status("m")) == (
            "False", "ManifestUnreadable"))
        await still_running(pool, "m", engine_id)
    path.write_text(sim_claim("m"))
    await pool.until("the file read again", lambda: spec(pool.status("m")) == ("True", "Applied"))
    await still_running(pool, "m", engine_id)


async def test_a_vanished_claims_directory_stops_nothing(pool: Pool, tmp_path: Path) -> None:
    pool.write("m", sim_claim("m"))
    await pool.start()
    engine_id = await running(pool, "m")
    saved = tmp_path / "saved"
    shutil.copytree(pool.dir, saved)
    shutil.rmtree(pool.dir)
    await pool.until("the directory reported", lambda: spec(pool.status("m")) == (
        "False", "ClaimsDirectoryUnreadable"))
    await still_running(pool, "m", engine_id)
    shutil.copytree(saved, pool.dir)
    await pool.until("the directory read again", lambda: spec(pool.status("m")) == (
        "True", "Applied"))
    await still_running(pool, "m", engine_id)


async def test_an_immutable_edit_keeps_the_running_spec_and_a_per_gpu_edit_takes_effect(
        pool: Pool) -> None:
    pool.write("m", sim_claim("m"))
    await pool.start()
    engine_id = await running(pool, "m")
    pool.write("m", sim_claim("m", **{"--max-model-len": "4096"}))
    await pool.until("the edit refused", lambda: spec(pool.status("m")) == (
        "False", "ImmutableFieldChanged"))
    st = pool.status("m")
    assert st is not None
    message = st.conditions["SpecApplied"].message
    assert "spec.engineConfig" in message and "delete" in message
    await still_running(pool, "m", engine_id)
    pool.write("m", sim_claim("m", footprint="5Gi"))
    await pool.until("perGPU taken", lambda: (s := pool.status("m")) is not None
                     and s.per_gpu is not None and s.per_gpu[0] == 5 << 30
                     and spec(s) == ("True", "Applied"))
    await still_running(pool, "m", engine_id)
