"""A KV segment name is claimed before any engine starts (runtime_agent/kv/ownership.py): a file
in the shm directory the agent cannot prove its engine's is refused with 409 and keeps its bytes,
mode and inode; a second agent sharing the directory is refused, never a tug of war; an agent
restart keeps holding (and setting back) its own segment."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from registry.identity import scan_engines
from runtime_agent.kv.ownership import NameTaken, claim, holds, marker_path, release
from runtime_agent.kv.segment import create_segment, read_segment, write_limit
from tests.harness import AgentProcess, http_json

MIB = 1 << 20


def activate(agent: AgentProcess, name: str, **extra: Any) -> tuple[int, Any]:
    body = {"model_name": name, "artifact_url": f"huggingface://test/{name}", "engine": "vllm",
            "engine_config": {"args": {"--sim-startup-seconds": "0.05"}}, **extra}
    return http_json(agent.url + "/v1/runtime/models/activate", "POST", body)


def fingerprint(path: Path) -> tuple[bytes, int, int]:
    st = path.lstat()
    return path.read_bytes(), stat.S_IMODE(st.st_mode), st.st_ino


def test_a_claim_is_exclusive_and_an_existing_segment_is_never_claimed(tmp_path: Path) -> None:
    inode = claim("kvc_a", tmp_path, "/state/one", "e1", lambda _: True)
    assert holds("kvc_a", tmp_path, inode, "e1")
    with pytest.raises(NameTaken, match="state directory '/state/one'"):
        claim("kvc_a", tmp_path, "/state/two", "e2", lambda _: False)
    # the same agent's marker of an engine it no longer has is its own leftover: taken over
    again = claim("kvc_a", tmp_path, "/state/one", "e3", lambda _: False)
    assert not holds("kvc_a", tmp_path, inode, "e1") and holds("kvc_a", tmp_path, again, "e3")
    assert claim("kvc_a", tmp_path, "/state/one", "e3", lambda _: False) == again  # its own
    release("kvc_a", tmp_path, again)
    assert not os.path.exists(marker_path("kvc_a", tmp_path))
    (tmp_path / "kvc_b").write_bytes(b"not ours")
    with pytest.raises(NameTaken, match="already exists"):
        claim("kvc_b", tmp_path, "/state/one", "e4", lambda _: False)
    assert not os.path.exists(marker_path("kvc_b", tmp_path))  # a refused claim leaves nothing
    proven = (tmp_path / "kvc_b").stat().st_ino  # a re-adopted engine's recorded segment
    assert holds("kvc_b", tmp_path, claim("kvc_b", tmp_path, "/s", "e5", lambda _: False,
                                          segment_inode=proven), "e5")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_foreign_shm_file_keeps_its_bytes_mode_and_inode_through_activate_and_deactivate(
        agent_factory: Any) -> None:
    agent = agent_factory()
    victim = agent.shm_dir / "kvc_victim"
    victim.write_bytes(b"precious\n")
    victim.chmod(0o644)
    before = fingerprint(victim)
    for name, extra in (("victim", {}), ("other", {"ipc_name": "kvc_victim"})):
        code, body = activate(agent, name, **extra)
        assert code == 409, body
        assert str(victim) in body["message"] and "another process owns it" in body["message"]
        assert http_json(agent.url + "/v1/runtime/models/deactivate", "POST",
                         {"model_name": name})[0] == 200
    assert fingerprint(victim) == before
    assert not list(scan_engines(str(agent.state_dir)))  # no engine was started
    assert sorted(p.name for p in agent.shm_dir.iterdir()) == ["kvc_victim"]


def kv_events(agent: AgentProcess, since: int, wait: int) -> tuple[list[str], int]:
    answer = agent.client.events(since, wait=wait)
    return [e.get("reason", "") for e in answer["events"]], int(answer["cursor"])


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_second_agent_on_the_same_shm_dir_is_refused_and_never_sets_the_segment_back(
        agent_factory: Any, tmp_path: Path) -> None:
    shared = tmp_path / "shared-shm"
    first = agent_factory(shm_dir=shared)
    second = agent_factory(shm_dir=shared)
    assert activate(first, "m", kv_limit_bytes=64 * MIB)[0] == 200
    first.wait_for(lambda s: first.model(s, "m")["kv_limit_applied_bytes"] == 64 * MIB,
                   what="the first agent's limit in force", poll_s=0.05)
    cursor = first.client.events(0)["cursor"]
    code, body = activate(second, "m", kv_limit_bytes=32 * MIB)
    assert code == 409, body
    assert "kvc_m.owner" in body["message"] and str(first.state_dir) in body["message"]
    assert not list(scan_engines(str(second.state_dir)))
    reasons: list[str] = []
    for _ in range(3):  # several hold intervals (0.2 s each): long polls of the events feed
        got, cursor = kv_events(first, cursor, wait=1)
        reasons += got
    assert "KVLimitSetBack" not in reasons and "KVLimitRestored" not in reasons, reasons
    info = read_segment("kvc_m", shared)
    assert info is not None and info.total_size == 64 * MIB


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_an_agent_restart_keeps_its_claim_and_still_sets_its_segment_back(
        agent_factory: Any, tmp_path: Path) -> None:
    agent = agent_factory()
    assert activate(agent, "m", kv_limit_bytes=64 * MIB)[0] == 200
    agent.wait_for(lambda s: agent.model(s, "m")["kv_limit_applied_bytes"] == 64 * MIB,
                   what="limit in force", poll_s=0.05)
    agent.kill()
    again = agent_factory(state_dir=agent.state_dir, shm_dir=agent.shm_dir)
    again.wait_phase("m", "active")
    cursor = again.client.events(0)["cursor"]
    write_limit("kvc_m", 128 * MIB, agent.shm_dir)  # an outside writer raises it
    seen: list[str] = []
    for _ in range(10):
        got, cursor = kv_events(again, cursor, wait=1)
        seen += got
        if "KVLimitSetBack" in seen:
            break
    assert "KVLimitSetBack" in seen
    assert read_segment("kvc_m", agent.shm_dir).total_size == 64 * MIB  # type: ignore[union-attr]
    assert http_json(again.url + "/v1/runtime/models/deactivate", "POST",
                     {"model_name": "m"})[0] == 200
    assert not os.path.exists(marker_path("kvc_m", agent.shm_dir))  # the name is given back


def test_create_segment_is_only_a_test_tool(tmp_path: Path) -> None:
    """The reference segment tool still works beside a claim marker (engines replace theirs)."""
    inode = claim("kvc_t", tmp_path, "/s", "e", lambda _: True)
    create_segment("kvc_t", MIB, tmp_path)
    assert holds("kvc_t", tmp_path, inode, "e")
