"""Every start-up mistake of `runtime-agent serve` is one line on stderr with its own exit code.

Each test runs the real command line as a separate process and checks the line names what to
fix, the exit code is the README's, no traceback is printed, and nothing of the registry was
touched (no lock, no engines directory) when the mistake was found before it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.harness import AgentProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(60)


def serve(tmp_path: Path, *extra: str, state: Path | None = None,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Start `serve` with a sound base command line plus ``extra`` (later flags win)."""
    (tmp_path / "shm").mkdir(exist_ok=True)
    for _ in range(5):
        port = free_port()
        argv = [sys.executable, "-m", "runtime_agent.cli", "serve", "--host", "127.0.0.1",
                "--port", str(port), "--state-dir", str(state or tmp_path / "state"),
                "--engines", "sim", "--kv-shm-dir", str(tmp_path / "shm"), "--log-format",
                "text", *extra]
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=45,
                             env={**os.environ, **(env or {})})
        if out.returncode != 5 or f"--port {port}:" not in out.stderr:
            return out
        # another process took the free port we were given before the agent bound it (the
        # harness picks again the same way): not what any test here is about
    return out


def one_line(out: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def untouched(state: Path) -> None:
    assert not (state / "agent.lock").exists() and not (state / "engines").exists()


@pytest.mark.parametrize("flags, words", [
    (("--port", "70000"), ("--port", "not a port")),
    (("--port", "http"), ("--port",)),
    (("--log-level", "loud"), ("--log-level", "invalid choice")),
    (("--simulate-gpus", "eight"), ("--simulate-gpus", "COUNTxSIZE")),
    (("--gpu-reserve", "lots"), ("--gpu-reserve",)),
    (("--restart-delays", "1,x"), ("--restart-delays",)),
    (("--stop-grace", "-1"), ("--stop-grace", "negative")),
    (("--scrape-interval", "0"), ("--scrape-interval", "more than 0")),
    (("--engines", "tgi"), ("--engines", "invalid choice")),
])
def test_a_bad_flag_value_is_one_line_and_exit_2(tmp_path: Path, flags: Sequence[str],
                                                 words: Sequence[str]) -> None:
    line = one_line(serve(tmp_path, *flags), 2, *words)
    assert line.endswith("(see runtime-agent serve --help)")
    untouched(tmp_path / "state")


def test_a_state_directory_that_cannot_be_created_is_exit_4(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    one_line(serve(tmp_path, state=blocker / "state"), 4, "--state-dir", str(blocker / "state"),
             "pick a directory")


def test_a_missing_kv_shm_directory_is_exit_4(tmp_path: Path) -> None:
    one_line(serve(tmp_path, "--kv-shm-dir", str(tmp_path / "nope")), 4, "--kv-shm-dir",
             "does not exist")
    untouched(tmp_path / "state")


def test_a_port_in_use_is_exit_5_before_the_registry_is_read(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = one_line(serve(tmp_path, "--port", str(port)), 5, f"--port {port}",
                        "already in use")
    assert "pick another --port" in line
    untouched(tmp_path / "state")


def test_a_host_that_is_not_this_machines_is_exit_5(tmp_path: Path) -> None:
    one_line(serve(tmp_path, "--host", "203.0.113.7", "--insecure-no-auth"), 5, "203.0.113.7",
             "not an address of this machine")


def test_the_reconcilers_port_on_the_agents_port_is_exit_5(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    port = str(free_port())
    one_line(serve(tmp_path, "--port", port, "--claims", str(claims), "--claims-port", port), 5,
             "--claims-port", "another port")


def test_nvml_asked_for_without_a_gpu_is_exit_6(tmp_path: Path) -> None:
    from runtime_agent.preflight import nvml_problem

    if nvml_problem() is None:
        pytest.skip("this machine has a GPU")
    one_line(serve(tmp_path, "--gpu", "nvml"), 6, "--gpu nvml", "--gpu sim")
    untouched(tmp_path / "state")


@pytest.mark.parametrize("content, words", [(None, ("cannot be read",)), ("", ("is empty",))])
def test_an_unusable_token_file_is_exit_7(tmp_path: Path, content: str | None,
                                          words: Sequence[str]) -> None:
    token = tmp_path / "token"
    if content is not None:
        token.write_text(content)
    one_line(serve(tmp_path, "--token-file", str(token)), 7, "--token-file", *words)


def test_a_claims_directory_that_does_not_exist_is_exit_7(tmp_path: Path) -> None:
    one_line(serve(tmp_path, "--claims", str(tmp_path / "nope")), 7, "--claims",
             "does not exist")


def test_a_state_directory_held_by_another_agent_is_exit_3(agent: AgentProcess,
                                                           tmp_path: Path) -> None:
    one_line(serve(tmp_path, state=agent.state_dir), 3, "another agent", "--state-dir")


# ---- engines that are not installed ------------------------------------------------------------


def test_a_missing_engine_is_a_warning_at_start_and_a_503_on_activate(agent_factory) -> None:
    agent: AgentProcess = agent_factory(extra_args=(
        "--engines", "vllm", "--vllm-command", "/nonexistent/vllm serve",
        "--sglang-command", f"{sys.executable} -m no_such_module_for_sglang"))
    log = agent.log_tail(80)
    assert "engine kind 'vllm' cannot run here: '/nonexistent/vllm'" in log
    assert "has no module 'no_such_module_for_sglang'" in log
    assert "engines are real" in log
    for engine in ("vllm", "sglang"):
        from runtime_agent.client import AgentError

        with pytest.raises(AgentError) as err:
            agent.client.activate(f"m-{engine}", "hf://test/m", engine)
        assert err.value.status == 503
        assert err.value.body["reason"] == "EngineExecutableMissing"
        assert "install it" in str(err.value)
    assert agent.client.snapshot()["models"] == []


def test_simulated_engines_are_said_at_start(agent: AgentProcess) -> None:
    assert "engines are SIMULATED (--engines sim)" in agent.log_tail(80)
