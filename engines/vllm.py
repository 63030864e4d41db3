"""The vLLM engine kind: validate an activation's arguments and build the engine's argv and env.

The simulated engine (``engines.sim``) accepts the same command line, so on a machine without a
GPU only the executable prefix changes. Flag values are separate argv items, never a shell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Flags the agent sets itself; an activation may not pass them.
AGENT_OWNED_FLAGS = frozenset(
    {"--model", "--served-model-name", "--host", "--port", "--enable-sleep-mode"}
)
# kvcached manages the KV cache, so vLLM must not size it from a utilisation fraction.
FORBIDDEN_FLAGS = frozenset({"--gpu-memory-utilization"})
_PARALLEL_FLAGS = ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size")


def normalise_flag(flag: str) -> str:
    """``--foo_bar`` and ``--foo-bar`` are the same vLLM flag; compare them in one spelling."""
    return flag.split("=", 1)[0].replace("_", "-")


def args_problem(args: Mapping[str, str]) -> str | None:
    """Why these engine arguments are invalid (reason InvalidEngineConfig), or None."""
    for flag, value in args.items():
        if not flag.startswith("-"):
            return f"engine_config.args key {flag!r} is not a flag: write it as '--{flag}'"
        norm = normalise_flag(flag)
        if norm in AGENT_OWNED_FLAGS:
            return f"{flag} is set by the runtime agent; leave it out of engine_config.args"
        if norm in FORBIDDEN_FLAGS:
            return f"{flag} is not allowed: kvcached manages the KV cache"
        if norm in _PARALLEL_FLAGS:
            if not value.isdigit() or int(value) < 1:
                return f"{flag} must be a positive whole number, got {value!r}"
            if norm == "--data-parallel-size" and int(value) != 1:
                return f"{flag} must be 1: data parallelism is not supported"
    return None


def model_argument(artifact_url: str) -> str:
    """What vLLM gets as MODEL: a Hugging Face repo id or a local path."""
    for scheme in ("huggingface://", "hf://"):
        if artifact_url.startswith(scheme):
            return artifact_url[len(scheme) :]
    if artifact_url.startswith("file://"):
        return artifact_url[len("file://") :]
    return artifact_url


def artifact_problem(artifact_url: str) -> str | None:
    if not artifact_url:
        return "artifact_url must not be empty"
    if "://" in artifact_url and not artifact_url.startswith(("huggingface://", "hf://", "file://")):
        scheme = artifact_url.split("://", 1)[0]
        return (
            f"artifact_url scheme {scheme!r} is not supported; "
            "use huggingface://org/name, hf://org/name, file:///path or a local path"
        )
    if len(model_argument(artifact_url)) == 0:
        return f"artifact_url {artifact_url!r} names no model"
    return None


def build_argv(
    command: Sequence[str],
    artifact_url: str,
    served_name: str,
    host: str,
    port: int,
    args: Mapping[str, str],
    sleep_mode: bool = True,
) -> list[str]:
    argv = [*command, model_argument(artifact_url)]
    argv += ["--served-model-name", served_name, "--host", host, "--port", str(port)]
    if sleep_mode:
        argv.append("--enable-sleep-mode")
    for flag, value in args.items():
        argv.append(flag)
        if value != "":
            argv.append(value)
    return argv


def build_env(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the sleep endpoints exist only in dev mode
    env.update(extra)
    return env
