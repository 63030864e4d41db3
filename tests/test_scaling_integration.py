"""Copies by demand end to end (issue 25, item 2): a local WarmPool of two real agents
(simulated GPUs and engines, separate processes), the reconciler and its door in this process
(``tests.test_replicas_integration``'s ``Pool``), clients over real sockets. A claim with
``replicas: 1`` and ``maxReplicas: 2`` gets a second engine on the other agent under a
sustained burst, the door spreads the burst over both, and idle time removes the copy."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.test_replicas_integration import Pool, pool, replicated

__all__ = ["pool"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def ranged(name: str, low: int, high: int, **args: str) -> str:
    text = replicated(name, low, **args)
    return text.replace(f"  replicas: {low}\n", f"  replicas: {low}\n  maxReplicas: {high}\n")


def reasons(pool: Pool) -> list[str]:
    st = pool.status("m")
    assert st is not None
    return [e.reason for e in st.events]


async def two_copies_by_a_burst(pool: Pool, sleep_after_s: int) -> None:
    """Claim ``m`` (1..2 engines, one call at a time, 1 s each) brought to two copies by four
    callers in a loop; the callers stopped once both serve."""
    pool.write_pool(f'{{"lifecycle": {{"sleepAfterSeconds": {sleep_after_s}}}}}')
    pool.write("m", ranged("m", 1, 2, **{"--max-num-seqs": "1", "--sim-request-seconds": "1"})
               .replace("6Gi", "2Gi", 1))
    await pool.start()
    await pool.serving("m", 1)
    assert pool.doc("m")["desiredReplicas"] == 1
    stop = time.monotonic() + 60
    statuses: list[int] = []

    async def caller() -> None:
        while time.monotonic() < stop and pool.doc("m")["readyReplicas"] < 2:
            statuses.append((await pool.chat("m-model"))[0])

    callers = [asyncio.ensure_future(caller()) for _ in range(4)]
    await pool.serving("m", 2)
    await asyncio.gather(*callers)
    assert set(statuses) == {200}
    doc = pool.doc("m")
    assert doc["desiredReplicas"] == 2
    assert sorted(i["pod"] for i in doc["instances"]) == ["agent-a", "agent-b"]
    assert "ScaledUp" in reasons(pool)


async def test_a_sustained_burst_adds_a_copy_on_the_other_agent_and_idle_time_removes_it(
        pool: Pool) -> None:
    """One call at a time per engine, 1 s each, and four callers in a loop: at the one copy a
    new call waits what is left of the soonest call plus three behind it (30 s each until the
    door has seen a latency, then about 1 s each), more than a 2 GiB copy's load (2 s) for 2 s,
    so a second copy starts on agent-b and the door spreads calls over both (had the copy gone
    to sleep since the burst, the queue at agent-a wakes it). Once the callers stop, the copy
    sleeps after 2 s idle and is removed after 4 s (twice that)."""
    await two_copies_by_a_burst(pool, sleep_after_s=2)
    before = len(pool.access())
    answers = await asyncio.gather(*(pool.chat("m-model") for _ in range(8)))
    assert [s for s, _ in answers] == [200] * 8
    await pool.until("8 more access lines", lambda: len(pool.access()) >= before + 8)
    agents = [line["upstream"].split()[0] for line in pool.access()[-8:]]
    assert sorted(set(agents)) == ["agent-a", "agent-b"], agents

    await pool.until("the copy removed", lambda: pool.doc("m")["desiredReplicas"] == 1
                     and pool.status("m#1") is None, 60)
    assert "agent-b" not in pool.engines("m-model")  # its engine was stopped
    assert pool.doc("m")["phase"] in ("Active", "Sleeping")
    events = reasons(pool)
    assert events.index("ScaledUp") < events.index("ScaledDown")


async def test_a_restarted_reconciler_keeps_the_copies_it_added(pool: Pool) -> None:
    """The count is the status's ``desiredReplicas``: a reconciler started again on the same
    state takes the second copy over (the same engine on agent-b), instead of draining it."""
    await two_copies_by_a_burst(pool, sleep_after_s=600)
    engine = pool.engines("m-model")["agent-b"]["engine_id"]
    assert pool.app is not None
    await pool.close()
    pool.app = None
    await pool.start()
    await pool.serving("m", 2)
    assert pool.doc("m")["desiredReplicas"] == 2
    assert pool.engines("m-model")["agent-b"]["engine_id"] == engine
