"""Command line of the simulated engine.

The agent launches engines with the command line real vLLM expects (``vllm serve MODEL
--served-model-name NAME --host H --port P --enable-sleep-mode ...``). The simulator accepts that
exact command line and refuses what the real engine would refuse: every flag is checked against the
real parser's list (``contract/flags/<kind>.tsv``, read with ``contract.flags.known_flags``), and a flag
the engine does not have ends the process with exit code 2 and argparse's "unrecognized arguments",
as ``vllm serve`` does. So a spec that works in the simulator works on the real engine. It models a
few of those flags, accepts the rest (``ignored_args``), and adds its own ``--sim-*`` knobs for tuning
and fault injection. Each ``--sim-*`` flag has an environment fallback (``SIM_STARTUP_SECONDS`` for
``--sim-startup-seconds`` and so on); the flag wins. Without them, starting, sleeping and waking
take as long as they would for a model of ``--sim-memory-bytes`` of weights (``engines.sim.timing``).
Like vLLM, ``--runner pooling`` (or the older ``--task embed``, ``--convert embed``) makes a pooling
model: it serves ``/v1/embeddings`` (``--sim-embedding-dim`` wide) instead of completions.

``--sim-mode sglang`` serves SGLang's HTTP API instead of vLLM's (``engines.sim.sglang_api``) and takes
SGLang's flags: the model comes from ``--model-path`` (or ``--model``), and ``--enable-memory-saver``,
``--enable-weights-cpu-backup``, ``--enable-metrics`` and ``--context-length`` are modelled.

``--sim-mode ollama`` turns the process into one ``ollama serve``: no flags but ``--sim-*`` (and
``--host``/``--port`` for convenience), the model as the positional argument, configuration from the
``OLLAMA_*`` environment (``engines.sim.ollama_config``). ``--sim-missing-model NAME`` (repeatable;
``SIM_MISSING_MODEL`` takes a comma-separated list) makes Ollama answer "model not found" for that name.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Callable

from contract.flags import invalid_values, known_flags, unrecognized
from contract.flags.values import ValueType, convert
from contract.quantity import GiB, KiB, MiB
from engines.sim.kvcache import DEFAULT_SHM_DIR, ipc_name_from_env, round_up_to_pages
from engines.sim.ollama_config import (
    OllamaSettings,
    normalize_model_name,
    settings_from_env,
)
from engines.sim.timing import start_seconds

SUPPORTED_MODES = ("vllm", "ollama", "sglang")
VLLM_DEFAULT_HOST = "0.0.0.0"
VLLM_DEFAULT_PORT = 8000
OLLAMA_STARTUP_S = 0.5
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class OptionsError(ValueError):
    """The command line or a SIM_* environment variable is unusable."""


@dataclass(frozen=True)
class SimOptions:
    """Everything the simulated engine needs to know, after flags and env are merged."""

    model: str
    served_model_names: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    enable_sleep_mode: bool = False
    max_model_len: int = 4096
    access_log: bool = True
    # Paths left out of the access log: vLLM's --disable-access-log-for-endpoints (exact paths),
    # SGLang's --uvicorn-access-log-exclude-prefixes (prefixes).
    quiet_paths: tuple[str, ...] = ()
    quiet_prefixes: tuple[str, ...] = ()
    mode: str = "vllm"
    startup_seconds: float = 0.5  # parse_options: the model's own (engines.sim.timing) unless given
    hang_on_start: bool = False
    crash_after: float | None = None
    crash_exit_code: int = 1
    fail_wake: bool = False
    sleep_seconds: float | None = None  # None: by the model's size and the level (engines.sim.timing)
    wake_seconds: float | None = None
    memory_bytes: int = GiB
    spawn_child: bool = False
    spawn_escaped: bool = False  # a helper in its own session, escaped from the group
    spawn_hidden: bool = False  # ... and with an empty environment: only a cgroup holds it
    request_seconds: float = 0.0
    token_seconds: float = 0.0
    max_running: int = 256
    kv_capacity_bytes: int = 2 * GiB
    kv_bytes_per_request: int = 64 * MiB
    kv_page_bytes: int = 2 * MiB
    kv_layers: int = 1
    reload_seconds: float | None = None  # vLLM: collective_rpc reload_weights (None: by the size)
    load_seconds: float = 0.2  # Ollama: loading one model
    stop_seconds: float = 0.0  # a SIGTERM ends the process this much later (a slow shutdown)
    kv_bytes_per_token: int = 64 * KiB  # Ollama: KV slab = this x context_length x num_parallel
    missing_models: tuple[str, ...] = ()  # Ollama: normalised names that answer "not found"
    runner: str = "generate"  # vLLM's --runner: "pooling" serves /v1/embeddings instead of completions
    embedding_dim: int = 384  # the width of the simulated embedding vectors
    ollama: OllamaSettings | None = None  # present in --sim-mode ollama
    # SGLang (--sim-mode sglang): the memory saver makes a release free memory; the CPU backup
    # keeps the weights through it; metrics only with --enable-metrics. /health on a released
    # engine waits SGLANG_HEALTH_CHECK_TIMEOUT seconds, then answers 503, as SGLang's does.
    enable_memory_saver: bool = False
    weights_cpu_backup: bool = False
    enable_metrics: bool = False
    health_timeout_s: float = 20.0
    enable_lora: bool = False  # --enable-lora (vLLM and SGLang): adapters may be loaded
    ignored_args: tuple[str, ...] = ()  # the real engine's flags that the simulator does not model
    # kvcached, from the environment like the real engine: ENABLE_KVCACHED=true and KVCACHED_IPC_NAME
    # (sanitised as kvcached does). KVCACHED_SHM_DIR is the simulator's own, for tests.
    kvcached_ipc_name: str | None = None
    kvcached_shm_dir: str = DEFAULT_SHM_DIR

    @property
    def served_model_name(self) -> str:
        """The primary name: reported by /v1/models, responses and metric labels."""
        return self.served_model_names[0]

    @property
    def kv_request_bytes(self) -> int:
        """KV one running request holds: the per-request bytes rounded up to whole pages on every layer."""
        return round_up_to_pages(self.kv_bytes_per_request, self.kv_page_bytes, self.kv_layers)


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


# (flag destination, type converter, default, is_boolean_flag)
_SIM_FLAGS: tuple[tuple[str, Callable[[str], Any], Any, bool], ...] = (
    ("mode", str, "vllm", False),
    ("startup_seconds", float, None, False),
    ("hang_on_start", _parse_bool, False, True),
    ("crash_after", float, None, False),
    ("crash_exit_code", int, 1, False),
    ("fail_wake", _parse_bool, False, True),
    ("sleep_seconds", float, None, False),
    ("wake_seconds", float, None, False),
    ("memory_bytes", int, GiB, False),
    ("spawn_child", _parse_bool, False, True),
    ("spawn_escaped", _parse_bool, False, True),
    ("spawn_hidden", _parse_bool, False, True),
    ("request_seconds", float, 0.0, False),
    ("token_seconds", float, 0.0, False),
    ("max_running", int, 256, False),
    ("kv_capacity_bytes", int, 2 * GiB, False),
    ("kv_bytes_per_request", int, 64 * MiB, False),
    ("kv_page_bytes", int, 2 * MiB, False),
    ("kv_layers", int, 1, False),
    ("reload_seconds", float, None, False),
    ("load_seconds", float, 0.2, False),
    ("kv_bytes_per_token", int, 64 * KiB, False),
    ("stop_seconds", float, 0.0, False),
    ("embedding_dim", int, 384, False),
)
# vLLM's --task values (older releases) and --convert values that make a pooling (embedding) model.
POOLING_TASKS = frozenset({"embed", "embedding", "classify", "score", "reward", "pooling"})


def _size(kind: str, word: str) -> Callable[[str], int]:
    """``type=`` for a length flag, read as the real engine reads it (``1k``, vLLM's ``auto``)."""
    def size(value: str) -> int:
        number = convert(value, ValueType(word), kind)
        assert isinstance(number, int)
        return number

    size.__name__ = word  # argparse names it in "invalid size value"
    return size


def build_parser() -> argparse.ArgumentParser:
    """The parser for the flags the simulator models; unknown flags are left to the caller."""
    parser = argparse.ArgumentParser(
        prog="python -m engines.sim",
        description="Simulated vLLM engine (OpenAI-compatible API, sleep mode, metrics) or, with "
                    "--sim-mode ollama, a simulated 'ollama serve'.",
        allow_abbrev=False,  # never let an unknown vLLM flag match one of ours by prefix
    )
    parser.add_argument("command", choices=["serve"], help="only 'serve' is supported")
    parser.add_argument("model_tag", nargs="?", default=None, help="model name or path")
    parser.add_argument("--model", dest="model_flag", default=None)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--max-model-len", type=_size("vllm", "size-or-auto"), default=4096)
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument("--disable-access-log-for-endpoints", default="")
    parser.add_argument("--uvicorn-access-log-exclude-prefixes", nargs="*", default=[])
    # SGLang's own spellings (--sim-mode sglang)
    parser.add_argument("--model-path", dest="model_path", default=None)
    parser.add_argument("--context-length", type=_size("sglang", "size"), default=None)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--runner", choices=["auto", "generate", "pooling", "draft"], default="auto")
    parser.add_argument("--task", default=None)
    parser.add_argument("--convert", default=None)
    for dest, convert, _default, is_bool in _SIM_FLAGS:
        flag = "--sim-" + dest.replace("_", "-")
        if is_bool:
            parser.add_argument(flag, dest=dest, action="store_const", const=True, default=None)
        else:
            parser.add_argument(flag, dest=dest, type=convert, default=None)
    parser.add_argument("--sim-missing-model", dest="missing_models", action="append", default=None,
                        metavar="NAME", help="(ollama) a model name that is not installed; repeatable")
    return parser


def _sim_value(
    namespace: argparse.Namespace,
    env: Mapping[str, str],
    dest: str,
    convert: Callable[[str], Any],
    default: Any,
) -> Any:
    flag_value = getattr(namespace, dest)
    if flag_value is not None:
        return flag_value
    env_name = "SIM_" + dest.upper()
    raw = env.get(env_name)
    if raw is None or (raw.strip() == "" and convert is not _parse_bool):
        return default
    try:
        return convert(raw)
    except ValueError as exc:
        raise OptionsError(f"{env_name}={raw!r}: {exc}") from exc


def parse_options(argv: Sequence[str], env: Mapping[str, str]) -> SimOptions:
    """Merge the command line and SIM_* environment into SimOptions; raise OptionsError if unusable."""
    parser = build_parser()
    try:
        namespace, unknown = parser.parse_known_args([_dashes(word) for word in argv])
    except SystemExit as exc:  # argparse already printed its message (or the --help text)
        if exc.code in (0, None):
            raise
        raise OptionsError(f"bad command line (exit {exc.code})") from exc
    model = namespace.model_tag or namespace.model_flag  # the positional wins, as in `vllm serve`
    sim = {dest: _sim_value(namespace, env, dest, conv, default) for dest, conv, default, _ in _SIM_FLAGS}
    if sim["mode"] not in SUPPORTED_MODES:
        raise OptionsError(f"--sim-mode {sim['mode']!r} is not supported (choose from {SUPPORTED_MODES})")
    refused = unrecognized(list(argv)[1:], accepted_flags(sim["mode"]), positionals=int(sim["mode"] != "sglang"))
    if refused:
        parser.prog = f"python -m engines.sim (simulated {sim['mode']})"
        parser.usage = f"%(prog)s serve [MODEL] [{sim['mode']}'s own flags] [--sim-*]"
        try:
            parser.error(f"unrecognized arguments: {' '.join(refused)}")
        except SystemExit as exc:  # argparse printed the usage and the error, as the real engine does
            raise OptionsError(f"unrecognized arguments: {' '.join(refused)}") from exc
    invalid = [] if sim["mode"] == "ollama" else invalid_values(
        list(argv)[1:], accepted_flags(sim["mode"]), sim["mode"],
        positionals=int(sim["mode"] != "sglang"))
    if invalid:  # as the real parser: usage, "argument --flag: invalid ... value", exit 2
        try:
            parser.error(f"argument {invalid[0]}")
        except SystemExit as exc:
            raise OptionsError(f"argument {invalid[0]}") from exc
    if sim["mode"] == "sglang":
        model = namespace.model_path or namespace.model_flag
        if not model:
            raise OptionsError("the following arguments are required: --model-path/--model")
    if not model and sim["mode"] == "vllm":
        raise OptionsError("a model is required: 'serve MODEL' or 'serve --model MODEL'")
    if sim["embedding_dim"] < 1:
        raise OptionsError("--sim-embedding-dim must be at least 1")
    if sim["max_running"] < 1:
        raise OptionsError("--sim-max-running must be at least 1")
    for dest in ("startup_seconds", "sleep_seconds", "wake_seconds", "request_seconds", "token_seconds",
                 "reload_seconds", "load_seconds", "stop_seconds"):
        if sim[dest] is not None and sim[dest] < 0:
            raise OptionsError(f"--sim-{dest.replace('_', '-')} must not be negative")
    if sim["startup_seconds"] is None:  # Ollama's server loads no model at start; its load is --sim-load-seconds
        sim["startup_seconds"] = OLLAMA_STARTUP_S if sim["mode"] == "ollama" else start_seconds(sim["memory_bytes"])
    if sim["crash_after"] is not None and sim["crash_after"] < 0:
        raise OptionsError("--sim-crash-after must not be negative")
    for dest in ("kv_capacity_bytes", "kv_page_bytes", "kv_layers"):
        if sim[dest] < 1:
            raise OptionsError(f"--sim-{dest.replace('_', '-')} must be at least 1")
    for dest in ("kv_bytes_per_request", "kv_bytes_per_token"):
        if sim[dest] < 0:
            raise OptionsError(f"--sim-{dest.replace('_', '-')} must not be negative")
    missing = namespace.missing_models
    if missing is None:
        missing = [part for part in env.get("SIM_MISSING_MODEL", "").split(",") if part.strip()]
    sim["missing_models"] = tuple(normalize_model_name(name) for name in missing)
    host = namespace.host or VLLM_DEFAULT_HOST
    port = VLLM_DEFAULT_PORT if namespace.port is None else namespace.port
    kvcached_ipc_name = ipc_name_from_env(env)
    ollama: OllamaSettings | None = None
    if sim["mode"] == "ollama":
        ollama = settings_from_env(env)
        host = namespace.host or ollama.host
        port = namespace.port if namespace.port is not None else ollama.port
        ollama = replace(ollama, host=host, port=port)
        kvcached_ipc_name = None  # Ollama's runners do not use kvcached
        model = model or ""
    names = tuple(namespace.served_model_name or (model,))
    pooling = namespace.runner == "pooling" or namespace.task in POOLING_TASKS \
        or namespace.convert in POOLING_TASKS
    return SimOptions(
        model=model,
        served_model_names=names,
        host=host,
        port=port,
        enable_sleep_mode=namespace.enable_sleep_mode,
        max_model_len=namespace.context_length or (4096 if namespace.max_model_len == -1
                                                   else namespace.max_model_len),  # -1: auto
        access_log=not namespace.disable_uvicorn_access_log,
        quiet_paths=tuple(p for p in namespace.disable_access_log_for_endpoints.split(",") if p),
        quiet_prefixes=tuple(namespace.uvicorn_access_log_exclude_prefixes),
        ignored_args=tuple(unknown),
        kvcached_ipc_name=kvcached_ipc_name,
        kvcached_shm_dir=env.get("KVCACHED_SHM_DIR") or DEFAULT_SHM_DIR,
        ollama=ollama,
        enable_memory_saver=namespace.enable_memory_saver,
        weights_cpu_backup=namespace.enable_weights_cpu_backup,
        enable_metrics=namespace.enable_metrics,
        enable_lora=namespace.enable_lora,
        health_timeout_s=_health_timeout(env),
        runner="pooling" if pooling else "generate",
        **sim,
    )


def _health_timeout(env: Mapping[str, str]) -> float:
    raw = env.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")
    try:
        return max(0.0, float(raw))
    except ValueError as exc:
        raise OptionsError(f"SGLANG_HEALTH_CHECK_TIMEOUT={raw!r}: {exc}") from exc


# ---- the real engines' flags ------------------------------------------------------------------


def accepted_flags(mode: str) -> dict[str, str]:
    """``{flag: arity}`` the simulated ``mode`` takes: its real engine's flags and ``--sim-*``."""
    sim = {"--sim-" + dest.replace("_", "-"): "no-value" if is_bool else "value"
           for dest, _c, _d, is_bool in _SIM_FLAGS}
    sim["--sim-missing-model"] = "value"
    if mode == "ollama":  # `ollama serve` takes no flags; --host/--port are the simulator's
        return {**sim, "--host": "value", "--port": "value"}
    return {**known_flags(mode), **sim}


def _dashes(word: str) -> str:
    """``--max_model_len=8`` as ``--max-model-len=8``: vLLM takes both spellings."""
    if not word.startswith("--"):
        return word
    name, eq, value = word.partition("=")
    return name.replace("_", "-") + eq + value
