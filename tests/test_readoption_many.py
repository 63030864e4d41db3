"""Many engines re-adopted at once (issue 26): every one back, none restarted, none lost.

A restarted agent checks its engines concurrently, each in its own owner. The records it read
are on disk as they stand: a re-adopted engine whose record did not change is not written again
(``registry.store``), and its view says ready as soon as it answered, before the scan of its
workers (``EngineOwner._on_ready``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import AgentProcess

pytestmark = pytest.mark.integration

ENGINES = 12


def records(state_dir: Path) -> dict[str, tuple[int, int]]:
    """Each record file's (inode, mtime): a rewrite is a new inode (temp file, rename)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in (state_dir / "engines").glob("*.json")}


@pytest.mark.timeout(180)
def test_a_dozen_engines_are_readopted_at_once_with_none_restarted(agent_factory) -> None:
    agent: AgentProcess = agent_factory()
    names = [f"m{i:02d}" for i in range(ENGINES)]
    for name in names:
        agent.activate_sim(name)
    before = {name: agent.wait_phase(name, "active", timeout_s=60) for name in names}
    settled = agent.wait_for(lambda s: all(m["ready"] for m in s["models"]), what="all ready")
    assert len(settled["models"]) == ENGINES
    agent.kill()  # SIGKILL: the engines live on in their own sessions
    on_disk = records(agent.state_dir)
    new = agent_factory(state_dir=agent.state_dir, start=False)
    new.port_low, new.port_high = agent.port_low, agent.port_high
    new.start()
    snap = new.wait_for(lambda s: len(s["models"]) == ENGINES and all(
        m["phase"] == "active" and m["ready"] and m["adopted"] for m in s["models"]),
        timeout_s=60, what="every engine re-adopted and ready")
    for name, first in before.items():
        model = new.model(snap, name)
        assert (model["pid"], model["port"], model["restart_count"]) == \
            (first["pid"], first["port"], 0)
    moves = {e["to"] for e in new.client.events(0)["events"]}
    assert not {"booting", "restarting", "failed"} & moves, moves
    # Records are written again only where they changed (a GPU peak measured since, say):
    # which ones is the sampler's timing; none is lost or added.
    assert set(records(agent.state_dir)) == set(on_disk)
