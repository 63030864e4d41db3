"""Start-up checks of ``runtime-agent serve``: every mistake found before the registry is read.

An operator's mistake at start-up (a state directory that cannot be written, a port in use, a
GPU that is not there, an unreadable token file) must end the agent at once, in one line on
stderr that names what to fix, with an exit code of its own (the table below and the README),
and before the agent takes over any engine the previous agent left running. ``check`` runs
every check in a fixed order and raises ``StartupError`` for the first mistake; what is only
worth a warning (an engine kind whose executable is missing: activations for it answer 503)
comes back in ``Checked.warnings``.

The agent's own port is bound here, and the bound sockets are handed to the agent, so the
port the check found free is the port the agent serves on: nothing can take it between the
check and the start, while the registry is read.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from msgspec import Struct, field

from guard import listen
from guard.tokens import TokenError, TokenSource, token_source
from runtime_agent.settings import Settings
from runtime_agent.statelock import StateDirBusy, StateLock
from runtime_agent.supervision.engine_kinds import command_prefix, executable_problem

T = TypeVar("T")

# Exit codes of ``runtime-agent serve`` (documented in the README; 3 predates this table).
EXIT_USAGE = 2  # a flag's value is invalid (argparse's own code)
EXIT_STATE_DIR_BUSY = 3  # another agent holds the state directory
EXIT_UNWRITABLE = 4  # a directory the agent writes cannot be created or written
EXIT_PORT = 5  # a port cannot be bound (in use, privileged, not an address of this host)
EXIT_GPU = 6  # --gpu nvml, and NVML finds no GPU
EXIT_UNREADABLE = 7  # an input the agent reads is missing or unreadable (token, claims)

ENGINE_KINDS = ("vllm", "sglang", "ollama")


class StartupError(Exception):
    """A mistake the operator must fix; ``str()`` is the one line to print."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Checked(Struct):
    """What the checks found: the bound listening sockets and the warnings to log."""

    sockets: list[socket.socket] = field(default_factory=list)
    probe_sockets: list[socket.socket] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    engine_problems: dict[str, str] = field(default_factory=dict)  # kind -> why it cannot run

    def close(self) -> None:
        for sock in (*self.sockets, *self.probe_sockets):
            sock.close()


def check(settings: Settings, *, claims_dir: str | None = None, claims_port: int | None = None,
          door: tuple[str, int] | None = None,
          nvml_probe: Callable[[], str | None] | None = None,
          module_probe: Callable[[Sequence[str]], str | None] | None = None) -> Checked:
    """Every start-up check, in order; raises StartupError for the first mistake."""
    writable_dir(settings.state_dir, "--state-dir", private=True)
    writable_dir(settings.kv_shm_dir, "--kv-shm-dir", create=False)
    if settings.weight_cache_dir is not None:
        writable_dir(settings.weight_cache_dir, "--weight-cache-dir (AIBRIX_WEIGHT_CACHE_DIR)")
    for root in settings.artifact_local_roots:
        readable_dir(root, "--artifact-local-root")
    if claims_dir is not None:
        readable_dir(Path(claims_dir), "--claims")
    if settings.gpu_backend == "nvml":
        problem = (nvml_probe or nvml_problem)()
        if problem is not None:
            raise StartupError(EXIT_GPU, f"--gpu nvml: {problem}; on a machine without a GPU "
                               "use --gpu auto or --gpu sim (a simulated GPU)")
    checked = Checked()
    # every port this process will listen on, each with its own line, before any starts
    _port(lambda: listen.distinct({
        "--port": settings.port, "--health-probe-port": settings.health_probe_port,
        "--claims-port": claims_port, "--door-port": door[1] if door is not None else None}))
    if claims_port is not None:
        check_free(settings.host, claims_port, "--claims-port")
    if door is not None and door[1] != 0:
        check_free(door[0], door[1], "--door-port")
    checked.sockets = bind(settings.host, settings.port, "--port")
    if (probe_port := settings.health_probe_port) is not None:
        try:
            checked.probe_sockets = bind(settings.host, probe_port, "--health-probe-port")
        except StartupError:
            checked.close()
            raise
    try:  # last: the lock file is the first thing of the registry's that gets written
        lock = StateLock(settings.state_dir)
        lock.acquire()
        lock.release()  # the agent takes it again for its life; one that wins the race meanwhile
    except StateDirBusy as exc:  # still stops it there, with the same line
        checked.close()
        raise StartupError(EXIT_STATE_DIR_BUSY, str(exc)) from None
    if not settings.simulate_engines:
        for kind in ENGINE_KINDS:
            problem = executable_problem(settings, kind)  # checked again on every activation
            command = command_prefix(settings, kind)
            if problem is None and "-m" in command[:-1]:  # checked here only: a child process
                problem = (module_probe or module_problem)(command)
                if problem is not None:
                    checked.engine_problems[kind] = problem
            if problem is not None:
                checked.warnings.append(f"engine kind {kind!r} cannot run here: {problem}; "
                                        f"activations with engine {kind!r} answer 503 "
                                        "EngineExecutableMissing until it is installed")
    return checked


# ---- directories ------------------------------------------------------------------------------


def writable_dir(path: Path, flag: str, *, private: bool = False, create: bool = True) -> None:
    """``path`` exists (or is created) as a directory this user can write."""
    if path.exists() and not path.is_dir():  # mkdir would say only "File exists"
        raise StartupError(EXIT_UNWRITABLE, f"{flag} {path} is a file, not a directory; "
                           f"point {flag.split()[0]} at a directory (it is created if missing)")
    try:
        if create:
            path.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)
        elif not path.exists():
            raise StartupError(EXIT_UNWRITABLE, f"{flag} {path} does not exist; create it or "
                               "point the flag at a directory that does")
        if not path.is_dir():
            raise StartupError(EXIT_UNWRITABLE, f"{flag} {path} is not a directory")
        probe = path / f".write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise StartupError(EXIT_UNWRITABLE, f"{flag} {path} cannot be used: "
                           f"{exc.strerror or exc}; pick a directory this user can write "
                           f"(e.g. {flag.split()[0]} /tmp/runtime-agent)") from None


def readable_dir(path: Path, flag: str) -> None:
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise StartupError(EXIT_UNREADABLE, f"{flag} {path} {what}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise StartupError(EXIT_UNREADABLE, f"{flag} {path} cannot be read by this user")


def read_token_file(path: str | None, env_token: str | None) -> str | None:
    """The API token from ``--token-file`` (or ``RUNTIME_AGENT_TOKEN``); None when neither."""
    source = token_source_of(path, env_token)
    return source.token() if source is not None else None


def token_source_of(path: str | None, env_token: str | None) -> TokenSource | None:
    """The token of ``--token-file`` (re-read when it changes) or ``RUNTIME_AGENT_TOKEN``, by
    ``guard.tokens``' one rule; None when neither."""
    try:
        return token_source(path, env_token)
    except TokenError as exc:
        raise StartupError(EXIT_UNREADABLE, str(exc)) from None


# ---- ports ------------------------------------------------------------------------------------


def bind(host: str, port: int, flag: str) -> list[socket.socket]:
    """``guard.listen.bind`` (the one port check of both commands) as a StartupError."""
    return _port(lambda: listen.bind(host, port, flag))


def check_free(host: str, port: int, flag: str) -> None:
    """A port a server binds itself later (the reconciler's, the door's): free now, or a
    StartupError naming the flag."""
    _port(lambda: listen.check_free(host, port, flag))


def _port(call: Callable[[], T]) -> T:
    try:
        return call()
    except listen.PortError as exc:
        raise StartupError(EXIT_USAGE if exc.usage else EXIT_PORT, str(exc)) from None


# ---- GPU and engines --------------------------------------------------------------------------


def nvml_problem() -> str | None:
    """Why NVML cannot be used here, or None (opens and closes NVML once)."""
    from runtime_agent.gpu.backend import GpuUnavailable
    from runtime_agent.gpu.nvml import NvmlBackend

    try:
        NvmlBackend().close()
    except GpuUnavailable as exc:
        return str(exc)
    return None


def module_problem(command: Sequence[str]) -> str | None:
    """``python -m pkg.mod``: is ``pkg`` importable by that interpreter? Only the top package
    is looked up (find_spec of a submodule would import the package, which can take long)."""
    module = command[list(command).index("-m") + 1]
    top = module.split(".")[0]
    exe = shutil.which(command[0]) or command[0]
    if os.path.realpath(exe) == os.path.realpath(sys.executable):
        found = importlib.util.find_spec(top) is not None
    else:
        try:
            found = subprocess.run(
                [exe, "-c", f"import importlib.util,sys; sys.exit(importlib.util.find_spec("
                 f"{top!r}) is None)"], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{command[0]} cannot be run: {exc}"
    return None if found else f"{command[0]} has no module {top!r} (pip install {top})"

