"""A full or read-only state directory, injected with a small tmpfs: the agent keeps control of
its engines, says what is wrong, and refuses only what it could not remember."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from runtime_agent.client import AgentError
from tests.artifact_peers import tmpfs
from tests.harness import AgentProcess, wait_until

pytestmark = pytest.mark.integration


def fill(disk: Path) -> Path:
    """Take every free byte of the tmpfs: the next record write gets ENOSPC."""
    filler = disk / "filler"
    with filler.open("wb") as out:
        try:
            while True:
                out.write(b"\0" * (1 << 20))
                out.flush()
        except OSError:
            pass
    return filler


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` read-only while inside: a bind mount of itself, remounted read-only."""
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def record_settled(state_dir: Path, phase: str) -> bool:
    """The one engine record says ``phase`` and no write of it is in flight."""
    names = [p.name for p in (state_dir / "engines").iterdir()]
    if len(names) != 1 or not names[0].endswith(".json"):
        return False
    return json.loads((state_dir / "engines" / names[0]).read_text())["phase"] == phase


@contextlib.contextmanager
def sim_gpu_apart(state_dir: Path) -> Iterator[Path]:
    """The simulated GPU's channel on a tmpfs of its own inside the state directory."""
    state_dir.mkdir(mode=0o700)
    with tmpfs(state_dir / "sim-gpu", "1m") as channel:
        yield channel


def test_a_full_state_directory_costs_no_control(agent_factory, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "4m") as disk, sim_gpu_apart(disk / "state"):
        # KV segments live apart, as on a node (/dev/shm), and so does the simulated GPU's
        # channel (NVML on a node): a dead engine's segment or report freed on the full disk
        # would let its record write through, and the test would race for it
        agent: AgentProcess = agent_factory(state_dir=disk / "state", shm_dir=tmp_path / "shm")
        first = agent.activate_sim("m1")
        agent.wait_phase("m1", "active")
        # the record says active a moment after the API does; filling the disk while that
        # write is in flight would leave the old record's pages free when it lands
        assert wait_until(lambda: record_settled(disk / "state", "active"), 10)
        filler = fill(disk)
        os.kill(first["pid"], signal.SIGKILL)  # its record cannot be written after this crash
        snap = agent.wait_for(lambda s: agent.model(s, "m1")["phase"] == "active"
                              and agent.model(s, "m1")["pid"] != first["pid"], timeout_s=20,
                              what="restarted on a full disk")
        assert "StorageUnavailable" in agent.model(snap, "m1")["conditions"]
        health = agent.client.health()
        assert health["status"] == "degraded" and "StorageUnavailable" in str(health)
        with pytest.raises(AgentError) as err:
            agent.activate_sim("m2")
        assert err.value.status == 503 and "state directory" in str(err.value)
        with pytest.raises(AgentError) as err:
            agent.client.sleep("m1")
        assert err.value.status == 503
        second = agent.model(snap, "m1")["pid"]
        assert agent.client.deactivate("m1")["phase"] == "stopped"  # an unlink still works
        assert wait_until(lambda: not psutil.pid_exists(second), 10)
        filler.unlink()
        agent.activate_sim("m2")
        agent.wait_phase("m2", "active")
        assert agent.client.health()["status"] == "ok"


def test_a_read_only_state_directory_refuses_a_stop_it_could_remember_nowhere(
        agent_factory, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "8m") as disk:
        agent: AgentProcess = agent_factory(state_dir=disk / "state")
        first = agent.activate_sim("m1")
        agent.wait_phase("m1", "active")
        engine_id = agent.model(agent.client.snapshot(), "m1")["engine_id"]
        (agent.shm_dir / f"{engine_id}.stopped").mkdir()  # no marker can be written either
        # a record write in flight holds a file open for writing: the remount would be refused
        assert wait_until(lambda: record_settled(disk / "state", "active"), 10)
        with read_only(disk / "state" / "engines"):
            with pytest.raises(AgentError) as err:
                agent.client.deactivate("m1")
            assert err.value.status == 503 and "cannot be written" in str(err.value)
            assert psutil.pid_exists(first["pid"])  # untouched: a restarted agent would
            # find its record and start it again, so the agent does not stop it
            model = agent.model(agent.client.snapshot(), "m1")
            assert model["phase"] == "active" and "StorageUnavailable" in model["conditions"]
        (agent.shm_dir / f"{engine_id}.stopped").rmdir()
        assert agent.client.deactivate("m1")["phase"] == "stopped"
