"""The command line as an operator uses it: each papercut of issue 13 has a test here.

Sizes with units, `--arg` in both spellings, URLs with or without a scheme, pointers between
the agent's and the reconciler's ports, `--version`, a quiet closed pipe, `-o json|yaml|wide`,
exit codes, and `--help` that names every default and environment variable.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from contract.endpoints import base_url
from agent_client import Reply
from runtime_agent.cli import parser
from runtime_agent.console.commands import follow, join_arg_values
from runtime_agent.console.output import quiet_on_closed_pipe
from tests.artifact_peers import cache_agent
from tests.harness import AgentProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(90)


def cli(*argv: str, env: dict[str, str] | None = None, **kwargs: Any
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime_agent.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})}, **kwargs)


# ---- pure parts -------------------------------------------------------------------------------


def test_sizes_take_units_everywhere() -> None:
    assert parser().parse_args(["kv-limit", "m", "1GiB"]).size == 2**30
    assert parser().parse_args(["kv-limit", "m", "512Mi"]).size == 2**29
    assert parser().parse_args(["kv-limit", "m", "1073741824"]).size == 2**30
    assert parser().parse_args(["activate", "m", "--artifact", "hf://a/b", "--kv-limit",
                                "2GiB"]).kv_limit == 2**31


@pytest.mark.parametrize("words, flags", [
    (["--arg", "--max-model-len=2048"], {"--max-model-len": "2048"}),
    (["--arg", "--max-model-len", "2048"], {"--max-model-len": "2048"}),
    (["--arg=--max-model-len=2048"], {"--max-model-len": "2048"}),
    (["--arg", "--enforce-eager", "--arg", "-tp", "1"], {"--enforce-eager": "", "-tp": "1"}),
    (["--arg", "--seed", "-1"], {"--seed": "-1"}),
])
def test_arg_takes_both_spellings(words: list[str], flags: dict[str, str]) -> None:
    from runtime_agent.console.commands import engine_flags

    argv = join_arg_values(["activate", "m", *words, "--artifact", "hf://a/b"])
    assert engine_flags(parser().parse_args(argv).arg) == flags


def test_a_flag_without_a_value_never_takes_the_next_word() -> None:
    argv = join_arg_values(["activate", "--arg", "--enforce-eager", "m", "--artifact", "x"])
    args = parser().parse_args(argv)
    assert (args.model, args.arg) == ("m", ["--enforce-eager"])


@pytest.mark.parametrize("text, url", [
    ("http://node1:8080", "http://node1:8080"), ("node1:8080", "http://node1:8080"),
    ("node1:8080/", "http://node1:8080"), (":8081", "http://127.0.0.1:8081"),
    ("8081", "http://127.0.0.1:8081"), ("https://agent.example", "https://agent.example"),
])
def test_urls_with_or_without_a_scheme(text: str, url: str) -> None:
    assert base_url(text) == url
    assert parser().parse_args(["snapshot", "--url", text]).url == url
    assert parser().parse_args(["claims", "get", "--url", text]).url == url


def test_a_url_with_another_scheme_is_one_line_and_exit_2() -> None:
    out = cli("snapshot", "--url", "ftp://node1")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "only http:// and https://" in out.stderr


def test_version() -> None:
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == "runtime-agent 0.1.0"


def test_help_names_every_environment_variable_and_exit_code() -> None:
    text = cli("--help").stdout
    for name in ("RUNTIME_AGENT_URL", "RUNTIME_AGENT_TOKEN", "RUNTIME_AGENT_TOKEN_FILE",
                 "RECONCILER_URL", "AIBRIX_WEIGHT_CACHE_DIR", "exit codes"):
        assert name in text, name


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]  # type: ignore[no-any-return]


@pytest.mark.parametrize("command", ["serve", "snapshot", "activate", "kv-limit", "logs", "top"])
def test_help_gives_every_flag_a_default(command: str) -> None:
    for action in _subparser(command)._actions:
        if not action.option_strings or action.help is None or action.required or \
                isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction,
                                    argparse._StoreConstAction)):
            continue
        assert "default" in action.help, f"{command} {action.option_strings} says no default"


def test_a_closed_pipe_ends_quietly() -> None:
    def writes() -> int:
        raise BrokenPipeError
    assert quiet_on_closed_pipe(writes) == 0
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    out = subprocess.run([sys.executable, "-m", "runtime_agent.cli", "--help"], cwd=ROOT,
                         stdout=write, stderr=subprocess.PIPE, text=True, timeout=30)
    os.close(write)
    assert "BrokenPipe" not in out.stderr and "Traceback" not in out.stderr


def test_an_agent_that_cannot_be_reached_is_one_line_and_exit_8() -> None:
    out = cli("snapshot", "--url", f"127.0.0.1:{free_port()}")
    assert out.returncode == 8 and len(out.stderr.strip().splitlines()) == 1
    assert "cannot reach the agent" in out.stderr and "RUNTIME_AGENT_URL" in out.stderr


def test_a_reconciler_that_cannot_be_reached_is_one_line_and_exit_8() -> None:
    out = cli("claims", "get", "--url", f"127.0.0.1:{free_port()}")
    assert out.returncode == 8 and len(out.stderr.strip().splitlines()) == 1
    assert "cannot reach the reconciler" in out.stderr and "RECONCILER_URL" in out.stderr


def test_another_service_at_the_address_is_named_as_such(tmp_path: Path) -> None:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # answers HTML
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = cli("snapshot", "--url", f"127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 8 and len(out.stderr.strip().splitlines()) == 1
    assert "did not answer as a runtime agent" in out.stderr and "not JSON" in out.stderr


class _Feed:
    """A client whose first answer is from another boot (the agent restarted)."""

    def __init__(self) -> None:
        self.pages = [{"events": [], "cursor": 9, "boot_id": "b2", "reset": True},
                      {"events": [{"ts": 0, "model": "m", "from": "booting", "to": "active",
                                   "reason": "Ready", "message": "ok", "seq": 1}],
                       "cursor": 1, "boot_id": "b2", "reset": False}]
        self.asked: list[tuple[int, str | None]] = []

    async def events(self, since: int, wait: int = 0, boot_id: str | None = None) -> Reply:
        self.asked.append((since, boot_id))
        return Reply(200, self.pages.pop(0))


async def test_events_say_when_the_agent_restarted_and_go_on(
        capsys: pytest.CaptureFixture[str]) -> None:
    feed = _Feed()
    assert await follow(feed, False, False) == 0  # type: ignore[arg-type]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("-- the agent restarted (boot b2)")
    assert out[1].endswith("m: booting -> active (Ready) ok")
    assert feed.asked == [(0, None), (0, "b2")]


# ---- against a running agent and its reconciler ----------------------------------------------


@pytest.fixture
def with_claims(agent_factory, tmp_path: Path) -> tuple[AgentProcess, str]:
    claims = tmp_path / "claims"
    claims.mkdir()
    agent: AgentProcess = agent_factory(extra_args=("--claims", str(claims)),
                                        free_ports=["--claims-port", "--door-port"])
    return agent, f"http://127.0.0.1:{agent.ports['--claims-port']}"


def test_each_side_points_to_the_other(with_claims: tuple[AgentProcess, str]) -> None:
    agent, reconciler = with_claims
    out = cli("claims", "get", "--url", agent.url.removeprefix("http://"))
    assert out.returncode == 1 and "is a runtime agent" in out.stderr
    assert "RECONCILER_URL" in out.stderr
    out = cli("snapshot", "--url", reconciler)
    assert out.returncode == 1 and "is a ModelClaim reconciler" in out.stderr
    assert "RUNTIME_AGENT_URL" in out.stderr
    assert cli("claims", "get", "-o", "yaml", "--url", reconciler).stdout.strip() == "[]"


def test_snapshot_prints_table_wide_json_and_yaml(agent: AgentProcess) -> None:
    agent.activate_sim("m1", kv_limit_bytes=64 * 2**30)  # more than the engine's KV capacity
    agent.wait_for(lambda s: agent.model(s, "m1")["kv_limit_applied_bytes"] is not None,
                   what="the limit applied")
    env = {"RUNTIME_AGENT_URL": agent.url.removeprefix("http://")}
    table = cli("snapshot", env=env).stdout
    assert "vllm (sim)" in table and "2.0GiB (cap)" in table
    assert "(cap): the engine created its KV cache with less than the limit asked" in table
    assert "(sim): a simulated engine" in table
    wide = cli("snapshot", "-o", "wide", env=env).stdout
    assert "KV CAP" in wide.splitlines()[0] and "LAST EXIT" in wide.splitlines()[0]
    as_json = json.loads(cli("snapshot", "-o", "json", env=env).stdout)
    as_yaml = yaml.safe_load(cli("snapshot", "-o", "yaml", env=env).stdout)
    assert as_json["models"][0]["model_name"] == as_yaml["models"][0]["model_name"] == "m1"
    model = as_json["models"][0]
    assert model["simulated"] is True and model["kv_limit_capped_by"] == "engine_kv_capacity"


def test_kv_limit_and_activate_from_the_command_line(agent: AgentProcess) -> None:
    env = {"RUNTIME_AGENT_URL": agent.url}
    out = cli("activate", "m1", "--artifact", "hf://test/m1", "--arg", "--max-model-len",
              "1024", "--arg", "--sim-startup-seconds=0.05", env=env)
    assert out.returncode == 0, out.stderr
    agent.wait_phase("m1", "active")
    assert agent.model(agent.client.snapshot(), "m1")["engine_args"]["--max-model-len"] == "1024"
    out = cli("kv-limit", "m1", "1GiB", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "kv-limit m1: 1.0GiB in force (the engine's KV capacity is 2.0GiB)\n"
    out = cli("kv-limit", "m1", "1GiB", "-o", "json", env=env)
    assert json.loads(out.stdout)["applied_bytes"] == 2**30
    out = cli("sleep", "nope", env=env)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "404" in out.stderr


def test_the_reconciler_speaks_of_invalid_manifests_and_leaves_the_directory_clean(
        agent_factory, tmp_path: Path) -> None:
    from tests.reconciler_fakes import claim_yaml

    claims = tmp_path / "claims"
    claims.mkdir()
    sim = {"--sim-startup-seconds": "0.1", "--sim-memory-bytes": str(2**30)}
    (claims / "good.yaml").write_text(claim_yaml("good", footprint="3Gi", args=sim))
    (claims / "bad.yaml").write_text(claim_yaml("bad", footprint="lots", args=sim))
    agent: AgentProcess = agent_factory(extra_args=(
        "--claims", str(claims), "--no-door", "--simulate-gpus", "1x16GiB"),
        free_ports=["--claims-port"])
    url = f"http://127.0.0.1:{agent.ports['--claims-port']}"
    agent.wait_phase("good", "active", timeout_s=30)
    out = cli("claims", "get", "--url", url)
    assert out.returncode == 0 and "good" in out.stdout
    lines = out.stdout.splitlines()
    note = lines.index("invalid manifests (not running; fix the file, or see `claims "
                       "describe NAME`):")
    assert "ModelClaim default/bad" in lines[note + 1] and "bad.yaml" in lines[note + 1]
    assert "perGPU" in lines[note + 1] or "maximumFootprint" in lines[note + 1]
    out = cli("claims", "describe", "bad", "--url", url)
    assert out.returncode == 1 and "its manifest is invalid" in out.stdout
    assert agent.log_tail(100_000).count("invalid manifest: ModelClaim default/bad") == 1
    # statuses live in the agent's state directory; the manifests' directory is as it was left
    assert sorted(p.name for p in claims.iterdir()) == ["bad.yaml", "good.yaml"]
    assert (agent.state_dir / "reconciler" / "default_good.json").is_file()


def test_statuses_kept_in_the_manifests_by_an_older_reconciler_move_once(tmp_path: Path) -> None:
    from reconciler.local.app import move_legacy_statuses

    claims, state = tmp_path / "claims", tmp_path / "state"
    (claims / ".status").mkdir(parents=True)
    (claims / ".status" / "default_m.json").write_text("{}")
    assert move_legacy_statuses(claims, state) == ["default_m.json"]
    assert (state / "default_m.json").read_text() == "{}" and not (claims / ".status").exists()
    (claims / ".status").mkdir()
    (claims / ".status" / "default_m.json").write_text('{"older": true}')
    assert move_legacy_statuses(claims, state) == []  # never over statuses already there
    assert (state / "default_m.json").read_text() == "{}"


def test_download_draws_its_progress_and_artifacts_lists_and_deletes(
        agent_factory, tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "m").mkdir(parents=True)
    (root / "m" / "config.json").write_bytes(b"{}")
    agent: AgentProcess = cache_agent(agent_factory, tmp_path / "cache",
                                      extra=("--artifact-local-root", str(root)))
    env = {"RUNTIME_AGENT_URL": agent.url}
    out = cli("download", f"file://{root}/m", env=env)
    assert out.returncode == 0, out.stderr
    local = Path(out.stdout.strip())  # the ready copy's path, and its progress on stderr
    assert (local / "config.json").read_bytes() == b"{}" and "ready" in out.stderr
    (listed,) = json.loads(cli("artifacts", "-o", "json", env=env).stdout)
    assert listed["local_path"] == str(local) and listed["state"] == "ready"
    assert listed["artifact_id"] in cli("artifacts", env=env).stdout  # the table
    out = cli("download", str(tmp_path / "outside"), env=env)
    assert out.returncode == 1 and "the agent answered 403" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = cli("artifacts", "--delete", listed["artifact_id"], env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(cli("artifacts", "-o", "json", env=env).stdout) == []


def test_mutating_commands_say_in_one_line_what_happened(agent: AgentProcess) -> None:
    env = {"RUNTIME_AGENT_URL": agent.url}
    agent.activate_sim("qwen", claim_ref={"namespace": "team", "name": "qwen-claim"})
    agent.wait_phase("qwen", "active")
    out = cli("sleep", "qwen", env=env)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"sleep qwen: asleep \(level 1\) in \d+\.\d s\n", out.stdout), out.stdout
    assert cli("sleep", "qwen", env=env).stdout == "sleep qwen: unchanged, already asleep\n"
    assert json.loads(cli("wake", "qwen", "-o", "json", env=env).stdout)["phase"] == "active"
    assert cli("wake", "qwen", env=env).stdout == "wake qwen: unchanged, already awake\n"
    out = cli("sleep", "qwen-claim", env=env)  # a claim's name where the model's belongs
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "'qwen-claim' is the name of the claim of model 'qwen'" in out.stderr
    out = cli("wake", "llama", env=env)
    assert out.returncode == 1 and out.stderr.rstrip().endswith("its models: qwen")
    out = cli("deactivate", "qwen", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith("warning: claim team/qwen-claim owns this engine")
    assert re.fullmatch(r"deactivate qwen: stopped in \d+\.\d s.*\n", out.stdout), out.stdout


def test_an_agent_command_pointed_at_the_door_says_so(agent_factory, tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    agent = agent_factory(extra_args=("--claims", str(claims)),
                          free_ports=["--claims-port", "--door-port"])
    door = agent.ports["--door-port"]
    out = cli("snapshot", "--url", f"127.0.0.1:{door}")
    assert out.returncode == 1 and "is the front door (OpenAI-compatible)" in out.stderr
    assert "not a runtime agent" in out.stderr


def test_wait_drained_waits_while_an_engine_runs_and_returns_once_none_does(
        agent: AgentProcess) -> None:
    env = {"RUNTIME_AGENT_URL": agent.url}
    agent.activate_sim("qwen")
    agent.wait_phase("qwen", "active")
    out = cli("wait-drained", "--timeout", "1", env=env)
    assert out.returncode == 1
    assert out.stdout == "1 engine(s) still run here: qwen\n"
    assert "1 s passed and 1 engine(s) still run here" in out.stderr
    with subprocess.Popen([sys.executable, "-m", "runtime_agent.cli", "wait-drained",
                           "--timeout", "30"], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, **env}) as waiting:
        assert waiting.stdout is not None
        assert waiting.stdout.readline() == "1 engine(s) still run here: qwen\n"
        assert cli("deactivate", "qwen", env=env).returncode == 0
        assert waiting.wait(timeout=30) == 0
        assert waiting.stdout.read() == "no engine runs here\n"
