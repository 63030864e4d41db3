"""The weight cache against a local Hub that speaks the Hub's protocol (huggingface_hub runs for
real): downloads, joins, checks, resumes, refusals, restarts and a full disk."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime_agent.client import AgentError
from tests.artifact_peers import cache_agent, entry, hub, tmpfs, tree, wait_entry  # noqa: F401
from tests.harness import AgentProcess, wait_until
from tests.hubserver import FakeHub

pytestmark = pytest.mark.integration
MIB = 1 << 20


def blob_path(hub: FakeHub, data: bytes) -> str:
    return f"/blobs/{hashlib.sha256(data).hexdigest()}"


def test_two_concurrent_requests_share_one_transfer_and_the_entry_is_checked(
        hub: FakeHub, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    weights = os.urandom(6 * MIB)
    config = b'{"architectures": ["Qwen3ForCausalLM"]}'
    commit = hub.add_repo("org/model", {"config.json": config, "model.safetensors": weights,
                                        "tokenizer/vocab.txt": b"a\nb\n"})
    hub.rate = 6 * MIB  # about a second: both requests arrive while it runs
    agent = cache_agent(agent_factory, tmp_path / "cache", hub)
    answers: list[dict] = []
    threads = [threading.Thread(target=lambda u=u: answers.append(agent.client.download(u)))
               for u in ("hf://org/model", "huggingface://org/model/")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({a["artifact_id"] for a in answers}) == 1
    assert sorted(a["started"] for a in answers) == [False, True]
    done = wait_entry(agent, answers[0]["artifact_id"])
    assert done["state"] == "ready", done
    assert done["resolved_revision"] == commit and done["revision"] == "main"
    assert done["bytes_done"] == done["bytes_total"] == len(weights) + len(config) + 4
    assert set(done["verified"]) == {"sha256", "git-sha1"}
    path = Path(done["local_path"])
    assert (path / "model.safetensors").read_bytes() == weights
    assert (path / "config.json").read_bytes() == config
    assert len(hub.gets(blob_path(hub, weights))) == 1  # one transfer for both requests
    snap = agent.client.snapshot()
    assert snap["cached_artifacts"] == ["huggingface://org/model"]
    assert snap["cached_artifact_details"][0]["size_bytes"] == done["bytes_total"]
    reasons = [e["reason"] for e in agent.client.events()["events"] if e.get("kind") == "artifact"]
    assert reasons[0] == "Started" and reasons[-1] == "Ready"
    metrics = agent.client._call("GET", "/healthz")  # the agent still answers
    assert metrics["status"] == "ok"
    body = agent_metrics(agent)
    assert 'aibrix:modelclaim_artifact_entries{state="ready"} 1.0' in body
    assert "aibrix:modelclaim_artifact_downloads_total{result=\"completed\"} 1.0" in body


def agent_metrics(agent: AgentProcess) -> str:
    import urllib.request

    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def test_a_typo_url_is_never_cached_and_unsupported_schemes_say_what_is(
        hub: FakeHub, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    agent = cache_agent(agent_factory, tmp_path / "cache", hub)
    with pytest.raises(AgentError) as err:
        agent.client.download("gcs://bucket/model")
    assert err.value.status == 422 and "huggingface://" in str(err.value) \
        and "s3://" in str(err.value)
    with pytest.raises(AgentError) as err:
        agent.client._call("POST", "/v1/model/download", {"artifact_url": "hf://a/b", "x": 1})
    assert err.value.status == 422 and err.value.body["detail"][0]["loc"] == ["body", "x"]
    missing = agent.client.download("hf://org/does-not-exist")
    failed = wait_entry(agent, missing["artifact_id"])
    assert failed["state"] == "failed" and failed["reason"] == "NotFound"
    assert agent.client.snapshot()["cached_artifacts"] == []


def test_revisions_are_pinned_and_a_private_repo_needs_the_token(
        hub: FakeHub, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    first = hub.add_repo("org/private", {"config.json": b"v1"}, token="hf_secret")
    second = hub.add_repo("org/private", {"config.json": b"v2"}, token="hf_secret")
    agent = cache_agent(agent_factory, tmp_path / "cache", hub)
    refused = wait_entry(agent, agent.client.download("hf://org/private")["artifact_id"])
    assert refused["state"] == "failed" and "HF_TOKEN" in refused["error"]
    latest = agent.client.download("hf://org/private", credentials={"HF_TOKEN": "hf_secret"})
    assert latest["started"] is True  # a failed entry starts again
    pinned = agent.client.download("hf://org/private", revision=first,
                                   credentials={"HF_TOKEN": "hf_secret"})
    latest = wait_entry(agent, latest["artifact_id"])
    pinned = wait_entry(agent, pinned["artifact_id"])
    assert latest["resolved_revision"] == second and pinned["resolved_revision"] == first
    assert (Path(pinned["local_path"]) / "config.json").read_bytes() == b"v1"
    assert (Path(latest["local_path"]) / "config.json").read_bytes() == b"v2"


def test_an_interrupted_download_fails_with_its_reason_and_resumes_with_a_range(
        hub: FakeHub, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    weights = os.urandom(24 * MIB)
    hub.add_repo("org/big", {"model.safetensors": weights})
    hub.cut_after["model.safetensors"] = 15 * MIB  # the connection breaks mid-file...
    hub.outage = True  # ...and the library's own retry finds the CDN down
    agent = cache_agent(agent_factory, tmp_path / "cache", hub)
    first = agent.client.download("hf://org/big")
    failed = wait_entry(agent, first["artifact_id"])
    assert failed["state"] == "failed" and failed["reason"] == "Network", failed
    assert failed["bytes_done"] >= 10 * MIB and failed["resumable"] is True
    cache = tmp_path / "cache" / ".aibrix" / "artifacts"
    assert tree(cache / "ready") == []  # nothing half-written where engines look
    hub.outage = False
    again = agent.client.download("hf://org/big")
    assert again["started"] is True
    done = wait_entry(agent, first["artifact_id"])
    assert done["state"] == "ready"
    assert (Path(done["local_path"]) / "model.safetensors").read_bytes() == weights
    ranges = [r for r in hub.gets(blob_path(hub, weights)) if r]
    assert ranges and int(ranges[-1].split("=")[1].rstrip("-")) >= 10 * MIB


def test_a_checksum_mismatch_leaves_nothing_and_says_so(
        hub: FakeHub, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    hub.add_repo("org/bad", {"model.safetensors": os.urandom(2 * MIB), "config.json": b"{}"})
    hub.corrupt.add("model.safetensors")
    agent = cache_agent(agent_factory, tmp_path / "cache", hub)
    first = agent.client.download("hf://org/bad")
    failed = wait_entry(agent, first["artifact_id"])
    assert failed["state"] == "failed" and failed["reason"] == "ChecksumMismatch"
    assert "sha256" in failed["error"] and "model.safetensors" in failed["error"]
    cache = tmp_path / "cache" / ".aibrix" / "artifacts"
    assert tree(cache / "ready") == []
    assert not [p for p in tree(cache / "staging") if "model.safetensors" in p]
    hub.corrupt.clear()
    agent.client.download("hf://org/bad")
    again = wait_entry(agent, first["artifact_id"])
    assert again["state"] == "ready", again["error"]


def test_a_sigkill_mid_download_leaves_a_consistent_cache_that_resumes(
        hub: FakeHub, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    weights = os.urandom(12 * MIB)
    hub.add_repo("org/slow", {"model.safetensors": weights})
    hub.add_repo("org/secret", {"model.safetensors": os.urandom(12 * MIB)}, token="tok")
    hub.rate = 4 * MIB
    cache_dir = tmp_path / "cache"
    agent = cache_agent(agent_factory, cache_dir, hub)
    plain = agent.client.download("hf://org/slow")["artifact_id"]
    secret = agent.client.download("hf://org/secret", credentials={"HF_TOKEN": "tok"})
    wait_entry(agent, plain, lambda e: e["bytes_done"] >= 2 * MIB)
    agent.kill()
    cache = cache_dir / ".aibrix" / "artifacts"
    assert tree(cache / "ready") == []
    hub.rate = None
    again = cache_agent(agent_factory, cache_dir, hub, env={"HF_TOKEN": ""})
    assert wait_entry(again, plain)["state"] == "ready"  # resumed without being asked
    ranges = [r for r in hub.gets(blob_path(hub, weights)) if r]
    assert ranges, "the restarted download did not resume with a Range request"
    assert (Path(entry(again, plain)["local_path"]) / "model.safetensors").read_bytes() == weights
    interrupted = entry(again, secret["artifact_id"])
    assert interrupted["state"] == "failed" and interrupted["reason"] == "Interrupted"
    again.client.download("hf://org/secret", credentials={"HF_TOKEN": "tok"})
    assert wait_entry(again, secret["artifact_id"])["state"] == "ready"
    assert not [p for p in tree(cache) if p.endswith(".part") or p.endswith(".tmp")]


def test_a_full_disk_is_refused_before_a_byte_moves_and_unused_entries_are_evicted(
        hub: FakeHub, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "32m") as disk:
        big, old, new = os.urandom(40 * MIB), os.urandom(12 * MIB), os.urandom(24 * MIB)
        hub.add_repo("org/huge", {"model.safetensors": big})
        hub.add_repo("org/old", {"model.safetensors": old})
        hub.add_repo("org/new", {"model.safetensors": new})
        agent = cache_agent(agent_factory, disk, hub)
        huge = wait_entry(agent, agent.client.download("hf://org/huge")["artifact_id"])
        assert huge["state"] == "failed" and huge["reason"] == "DiskFull"
        assert "not enough disk space" in huge["error"]
        assert hub.gets(blob_path(hub, big)) == []  # refused before the download
        first = wait_entry(agent, agent.client.download("hf://org/old")["artifact_id"])
        assert first["state"] == "ready"
        second = wait_entry(agent, agent.client.download("hf://org/new")["artifact_id"])
        assert second["state"] == "ready"  # room made by evicting the unused old entry
        assert entry(agent, first["artifact_id"]) is None
        events = agent.client.events()["events"]
        assert any(e.get("reason") == "Evicted" and e["artifact_url"] == "huggingface://org/old"
                   for e in events)
        # The disk fills up during a download: it fails with the reason, and resumes later.
        agent.client.delete_artifact(second["artifact_id"])
        hub.rate = 8 * MIB
        third = agent.client.download("hf://org/new")["artifact_id"]
        # huggingface_hub writes 10 MiB at a time: fill the disk once the first is written.
        wait_entry(agent, third, lambda e: e["bytes_done"] >= 10 * MIB)
        filler = disk / "filler"
        with open(filler, "wb") as f, pytest.raises(OSError):
            f.write(os.urandom(32 * MIB))
        hub.rate = None
        failed = wait_entry(agent, third)
        assert failed["state"] == "failed" and failed["reason"] == "DiskFull", failed
        filler.unlink()
        agent.client.download("hf://org/new")
        assert wait_entry(agent, third)["state"] == "ready"
        assert [r for r in hub.gets(blob_path(hub, new)) if r]  # resumed, not restarted
        agent.cleanup()


def test_delete_frees_an_entry_and_refuses_one_unknown(
        hub: FakeHub, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    hub.add_repo("org/m", {"config.json": b"{}"})
    agent = cache_agent(agent_factory, tmp_path / "cache", hub)
    done = wait_entry(agent, agent.client.download("hf://org/m")["artifact_id"])
    agent.client.delete_artifact(done["artifact_id"])
    assert agent.client.artifacts() == []
    assert not Path(done["local_path"]).exists()
    with pytest.raises(AgentError) as err:
        agent.client.delete_artifact("nope")
    assert err.value.status == 404
    assert wait_until(lambda: agent.client.snapshot()["cached_artifacts"] == [], 5)
