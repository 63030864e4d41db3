"""The weight cache against moto's S3 server and local paths, and activations that use the cache."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime_agent.client import AgentError
from tests.artifact_peers import (  # noqa: F401 - fixtures
    NO_AWS,
    S3_ENV,
    cache_agent,
    entry,
    hub,
    s3,
    wait_entry,
)
from tests.harness import AgentProcess
from tests.hubserver import FakeHub

pytestmark = pytest.mark.integration
MIB = 1 << 20


def put_model(client: Any, prefix: str) -> dict[str, bytes]:
    client.create_bucket(Bucket="models")
    files = {"config.json": b'{"a": 1}', "model-00001.safetensors": os.urandom(3 * MIB),
             "sub/tokenizer.json": b"{}" * 100}
    for name, data in files.items():
        extra = {"ChecksumAlgorithm": "SHA256"} if name.endswith(".safetensors") else {}
        client.put_object(Bucket="models", Key=f"{prefix}/{name}", Body=data, **extra)
    return files


def test_an_s3_prefix_is_staged_with_its_checksums_using_the_request_credentials(
        s3: tuple[str, Any], agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    endpoint, client = s3
    files = put_model(client, "qwen")
    agent = cache_agent(agent_factory, tmp_path / "cache", s3_endpoint=endpoint, env=NO_AWS)
    nocreds = wait_entry(agent, agent.client.download("s3://models/qwen")["artifact_id"])
    assert nocreds["state"] == "failed" and nocreds["reason"] == "Unauthorized", nocreds
    started = agent.client.download("s3://models/qwen/", credentials=S3_ENV)
    done = wait_entry(agent, started["artifact_id"])
    assert done["state"] == "ready", done
    assert set(done["verified"]) >= {"sha256"}
    root = Path(done["local_path"])
    for name, data in files.items():
        assert (root / name).read_bytes() == data
    single = agent.client.download("s3://models/qwen/config.json", credentials=S3_ENV)
    one = wait_entry(agent, single["artifact_id"])
    assert one["state"] == "ready" and one["files"] == 1
    missing = wait_entry(agent, agent.client.download("s3://models/nothing-here",
                                                      credentials=S3_ENV)["artifact_id"])
    assert missing["state"] == "failed" and missing["reason"] == "NotFound"


def test_local_paths_are_copied_only_inside_the_roots_and_refusals_reveal_nothing(
        agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "m").mkdir(parents=True)
    (root / "m" / "config.json").write_bytes(b"{}")
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    agent = cache_agent(agent_factory, tmp_path / "cache", extra=("--artifact-local-root",
                                                                  str(root)))
    done = wait_entry(agent, agent.client.download(f"file://{root}/m")["artifact_id"])
    assert done["state"] == "ready"
    assert (Path(done["local_path"]) / "config.json").read_bytes() == b"{}"
    answers = []
    for path in (outside, tmp_path / "no-such-dir", root / "escape", root / "escape" / "x"):
        with pytest.raises(AgentError) as err:
            agent.client.download(str(path))
        answers.append((err.value.status, str(err.value)))
    assert len(set(answers)) == 1 and answers[0][0] == 403  # the same answer, exists or not
    with pytest.raises(AgentError) as err:
        agent.client.download(f"{root}/absent")
    assert err.value.status == 404


def test_an_s3_activation_stages_first_then_starts_the_engine_on_the_local_copy(
        s3: tuple[str, Any], agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    endpoint, client = s3
    put_model(client, "qwen")
    agent = cache_agent(agent_factory, tmp_path / "cache", s3_endpoint=endpoint, env=S3_ENV)
    result = agent.activate_sim("m1", artifact_url="s3://models/qwen")
    assert result["status"] == "success"
    model = agent.wait_phase("m1", "active")
    reasons = [(e["from"], e["to"], e["reason"]) for e in agent.client.events()["events"]
               if e.get("model") == "m1"]
    assert ("activating", "activating", "Staging") in reasons
    staged = next(e for e in agent.client.artifacts() if e["artifact_url"] == "s3://models/qwen")
    cmdline = Path(f"/proc/{model['pid']}/cmdline").read_bytes().split(b"\0")
    assert staged["local_path"].encode() in cmdline  # started on the cache's copy
    assert staged["in_use"] is True
    with pytest.raises(AgentError) as err:
        agent.client.delete_artifact(staged["artifact_id"])
    assert err.value.status == 409 and "m1" in str(err.value)
    agent.client.deactivate("m1")
    agent.client.delete_artifact(staged["artifact_id"])


def test_a_hub_activation_waits_for_the_download_in_flight_and_shows_its_progress(
        hub: FakeHub, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    weights = os.urandom(8 * MIB)
    hub.add_repo("org/warm", {"model.safetensors": weights})
    hub.rate = 2 * MIB
    agent = cache_agent(agent_factory, tmp_path / "cache", hub)
    agent.client.download("hf://org/warm")
    agent.activate_sim("warm", artifact_url="huggingface://org/warm")
    snap = agent.wait_for(lambda s: "Staging" in (agent.model(s, "warm") or {}).get(
        "conditions", ()), what="the Staging condition")
    model = agent.model(snap, "warm")
    assert model["phase"] == "activating" and model["staging"]["bytes_total"] == len(weights)
    hub.rate = None
    model = agent.wait_phase("warm", "active")
    assert model["staging"] is None and "Staging" not in model["conditions"]
    assert len([r for r in hub.gets(f"/blobs/{hashlib.sha256(weights).hexdigest()}")]) == 1


def test_a_staging_failure_fails_the_engine_with_the_reason(
        s3: tuple[str, Any], agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    endpoint, client = s3
    client.create_bucket(Bucket="models")
    agent = cache_agent(agent_factory, tmp_path / "cache", s3_endpoint=endpoint, env=S3_ENV)
    # The activation waits up to 2 s for its staging: a failure inside them is in the answer
    # (moto answers in milliseconds); on a starved machine the answer may come first, and the
    # failure is then the engine's alone. Either way the engine ends failed with the reason.
    try:
        answer = agent.activate_sim("m1", artifact_url="s3://models/absent")
        assert answer["status"] == "success" and answer.get("phase") in (None, "activating")
    except AgentError as err:
        assert "NotFound" in str(err), err
    model = agent.wait_phase("m1", "failed")
    assert "staging s3://models/absent failed" in model["last_error"] and \
        "NotFound" in model["last_error"]
