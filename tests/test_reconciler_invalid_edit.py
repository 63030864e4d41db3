"""A claim edited into an invalid one (issue 22): a misspelt field (``artifactUrl``) or an
unknown engine (``vlm``) in a running claim's file keeps the last valid version running, and
says so where an operator looks: ``SpecApplied False InvalidSpec`` naming the field, in the
claim's status, ``claims get`` and ``claims describe`` (run as the real CLI process), as
broken YAML and immutable edits already do."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from reconciler.cli import spec_warnings
from tests.test_reconciler_faults import pool, running, spec, still_running
from tests.test_reconciler_integration import Pool, sim_claim

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
__all__ = ["pool"]  # the fixture, used by name

ROOT = Path(__file__).resolve().parent.parent


async def cli(*argv: str) -> str:
    """``runtime-agent`` as its own process; its output (it must exit 0)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "runtime_agent.cli", *argv, cwd=ROOT, start_new_session=True,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert proc.returncode == 0, out.decode()
    return out.decode()


@pytest.mark.parametrize(("old", "new", "field"), [
    ("artifactURL:", "artifactUrl:", "spec.artifactUrl"),
    ("engine: vllm", "engine: vlm", "spec.engine"),
], ids=["misspelt-field", "unknown-engine"])
async def test_an_invalid_edit_of_a_running_claim_says_so_and_keeps_the_last_valid_version(
        pool: Pool, old: str, new: str, field: str) -> None:
    pool.write("m", sim_claim("m"))
    await pool.start()
    engine_id = await running(pool, "m")
    assert old in sim_claim("m")
    pool.write("m", sim_claim("m").replace(old, new))
    await pool.until("the invalid edit reported", lambda: spec(pool.status("m")) == (
        "False", "InvalidSpec"))
    st = pool.status("m")
    assert st is not None
    message = st.conditions["SpecApplied"].message
    assert field in message and "last valid version" in message, message
    assert any(e.reason == "InvalidSpec" and e.type == "Warning" for e in st.events)
    await still_running(pool, "m", engine_id)
    listed = await pool.get("/v1/claims")
    assert any("InvalidSpec" in line and field in line for line in spec_warnings(listed["items"]))
    assert pool.app is not None
    url = f"http://127.0.0.1:{pool.app.port}"
    got = await cli("claims", "get", "--url", url)
    assert "InvalidSpec" in got and field in got, got
    described = await cli("claims", "describe", "m", "--url", url)
    assert "InvalidSpec" in described and field in described, described
    assert "the claim runs as declared" not in described, described
    pool.write("m", sim_claim("m"))
    await pool.until("the fix taken", lambda: spec(pool.status("m")) == ("True", "Applied"))
    await still_running(pool, "m", engine_id)
