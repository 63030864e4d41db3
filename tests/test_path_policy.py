"""The one local-path rule (guard/paths.py): every spelling of a path outside the allowed roots
is refused with one status and one message, whether or not it exists; the LoRA route and the
weight cache use it, tried against a real agent process with a LoRA-enabled simulated engine."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guard.paths import Allowed, Refused, is_hub_repo_id, judge_local_path, outside_message
from tests.harness import AgentProcess, http_json

PREFIXES = ("", "file://", "file:", "file://localhost", "file:/", " ", "\t", "~", "~root",
            "./", "../", ".", "//")
SUFFIXES = ("", "/", " ", "\x00", "\n", "/.", "/..", "%00")


def world(tmp: Path) -> tuple[Path, list[str]]:
    """A root with an adapter, a link that leads out, and outside targets (some exist)."""
    root = tmp / "root"
    (root / "adapter").mkdir(parents=True, exist_ok=True)
    (tmp / "outside").mkdir(exist_ok=True)
    (tmp / "outside" / "secret").write_text("x")
    link = root / "link"
    if not link.is_symlink():
        link.symlink_to(tmp / "outside")
    bodies = [str(tmp / "outside"), str(tmp / "outside" / "secret"), str(tmp / "absent"),
              str(link), str(link / "secret"), str(link / "absent"), f"{root}/../outside",
              f"{root}/adapter/../../outside", f"{root}//..//outside", f"{root}/%2e%2e/outside",
              f"{root}/%2E%2E/absent", "/etc", "/etc/passwd", "/root/.ssh", "/", f"{root}x",
              "~root/.ssh", "~/.ssh", "etc/../etc/passwd", "./etc/passwd", "root/../../etc"]
    return root, bodies


def outside_spellings(bodies: list[str]) -> st.SearchStrategy[str]:
    return st.builds(lambda p, b, s: p + b + s, st.sampled_from(PREFIXES),
                     st.sampled_from(bodies), st.sampled_from(SUFFIXES)).filter(
        lambda text: not is_hub_repo_id(text))


def test_a_path_inside_a_root_is_allowed_as_written_and_resolved(tmp_path: Path) -> None:
    root, _ = world(tmp_path)
    for spelled in (f"{root}/adapter", f"file://{root}/adapter", f"{root}/adapter/"):
        verdict = judge_local_path(spelled, (root,))
        assert isinstance(verdict, Allowed), spelled
        assert verdict.real == os.path.realpath(root / "adapter")
    assert judge_local_path(f"{root}/missing", (root,)) == Refused(
        404, f"local path {root}/missing does not exist")


@settings(max_examples=300)
@given(data=st.data())
def test_every_spelling_outside_the_roots_gets_the_same_refusal(tmp_path_factory: Any,
                                                               data: st.DataObject) -> None:
    tmp = tmp_path_factory.getbasetemp() / "policy"
    root, bodies = world(tmp)
    spelled = data.draw(outside_spellings(bodies))
    assert judge_local_path(spelled, (root,)) == Refused(403, outside_message((root,)))


@given(text=st.text(max_size=40))
def test_no_text_is_allowed_that_is_not_a_plain_absolute_path_inside_the_root(
        tmp_path_factory: Any, text: str) -> None:
    root, _ = world(tmp_path_factory.getbasetemp() / "policy")
    for spelled in (text, f"{root}/{text}", f"file://{root}/{text}"):
        verdict = judge_local_path(spelled, (root,))
        if isinstance(verdict, Allowed):
            assert verdict.real.startswith(os.path.realpath(root))
            assert spelled.isprintable() and " " not in spelled and "%" not in spelled
            assert "/../" not in spelled + "/" and "/./" not in spelled + "/"
        else:
            assert verdict.status in (403, 404)


def test_without_roots_every_local_path_is_refused_as_the_cache_refuses_it(
        tmp_path: Path) -> None:
    root, _ = world(tmp_path)
    verdict = judge_local_path(str(root / "adapter"), ())
    assert isinstance(verdict, Refused) and verdict.status == 403
    assert "--artifact-local-root" in verdict.message


# ---- the LoRA route of a real agent -------------------------------------------------------------


@pytest.fixture
def lora_agent(agent_factory: Any, tmp_path: Path) -> tuple[AgentProcess, Path, list[str]]:
    root, bodies = world(tmp_path)
    agent = agent_factory(extra_args=("--artifact-local-root", str(root)))
    agent.activate_sim("base", "--enable-lora=")
    agent.wait_phase("base", "active")
    return agent, root, bodies


def load(agent: AgentProcess, body: dict[str, Any]) -> tuple[int, Any]:
    return http_json(agent.url + "/v1/lora_adapter/load", "POST", body)


@pytest.mark.integration
@pytest.mark.timeout(240)
@settings(max_examples=80, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_lora_route_refuses_every_spelling_outside_the_roots_with_one_answer(
        lora_agent: tuple[AgentProcess, Path, list[str]], data: st.DataObject) -> None:
    agent, root, bodies = lora_agent
    spelled = data.draw(outside_spellings(bodies))
    delegated = data.draw(st.booleans())
    body = ({"lora_name": "a", "artifact_url": spelled} if delegated and spelled.startswith(
        "file://") else {"lora_name": "a", "lora_path": spelled})
    code, answer = load(agent, body)
    assert (code, answer.get("message")) == (403, outside_message((root,))), (spelled, answer)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_the_lora_route_loads_inside_the_roots_and_lists_nothing_it_refused(
        lora_agent: tuple[AgentProcess, Path, list[str]]) -> None:
    agent, root, bodies = lora_agent
    for spelled in ("~root/.ssh", "etc/../passwd", " /etc", "file:///etc", f"{root}/link"):
        assert load(agent, {"lora_name": "bad", "lora_path": spelled})[0] == 403, spelled
    assert load(agent, {"lora_name": "good", "lora_path": f"file://{root}/adapter"})[0] == 200
    _, models = http_json(agent.url + "/v1/models")
    adapters = {m["id"]: m["root"] for m in models["data"] if m["parent"] == "base"}
    assert adapters == {"good": f"{root}/adapter"}


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_an_engine_runs_in_an_empty_directory_so_a_relative_lora_path_names_nothing_local(
        lora_agent: tuple[AgentProcess, Path, list[str]]) -> None:
    """``etc/passwd`` is spelled like a Hub repo id, and vLLM loads it as a local path when it
    exists relative to its working directory: the engine's is an empty one of the agent's."""
    agent, _, _ = lora_agent
    pid = agent.model(agent.client.snapshot(), "base")["pid"]
    cwd = os.readlink(f"/proc/{pid}/cwd")
    assert cwd == str(agent.state_dir.absolute() / "engine-cwd")
    assert os.listdir(cwd) == [] and stat.S_IMODE(os.stat(cwd).st_mode) == 0o700
    assert load(agent, {"lora_name": "hub", "lora_path": "etc/passwd"})[0] == 200  # a repo id
