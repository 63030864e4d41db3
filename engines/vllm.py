"""The vLLM engine kind: validation, command line, and vLLM's own HTTP API for the supervisor.

The simulated engine (``engines.sim``) accepts the same command line, so on a machine without a
GPU only the executable prefix changes. Flag values are separate argv items, never a shell.
Sleep state comes from ``/is_sleeping``, never from ``/health`` (200 while asleep). Waking
from a level-2 sleep (weights discarded) follows vLLM's documented sequence: reallocate the
weights, reload them in place, then reallocate the KV cache; a plain wake would serve with
garbage weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import aiohttp

from engines.adapter import LaunchContext, Observation, local_artifact_problem
from engines.client import EngineClient
from registry.record import EngineRecord

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


def args_problem(args: Mapping[str, str], device_count: int | None = None) -> str | None:
    """Why these engine arguments are invalid (reason InvalidEngineConfig), or None.

    With ``device_count``, tensor x pipeline parallel size must fit the Pod's GPUs.
    """
    sizes = {"--tensor-parallel-size": 1, "--pipeline-parallel-size": 1}
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
            if norm in sizes:
                sizes[norm] = int(value)
    needed = sizes["--tensor-parallel-size"] * sizes["--pipeline-parallel-size"]
    if device_count is not None and needed > device_count:
        return (f"--tensor-parallel-size x --pipeline-parallel-size is {needed}, but this Pod "
                f"has {device_count} GPU{'s' if device_count != 1 else ''}")
    return None


def gpus_needed(args: Mapping[str, str]) -> int:
    """GPUs one engine uses: tensor x pipeline parallel size (validated beforehand)."""
    sizes = {normalise_flag(k): v for k, v in args.items()}
    tp = sizes.get("--tensor-parallel-size", "1")
    pp = sizes.get("--pipeline-parallel-size", "1")
    return (int(tp) if tp.isdigit() else 1) * (int(pp) if pp.isdigit() else 1)


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
    model = model_argument(artifact_url)
    if len(model) == 0:
        return f"artifact_url {artifact_url!r} names no model"
    if artifact_url.startswith("file://") or artifact_url.startswith(("/", "./", "../")):
        return local_artifact_problem(model)
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


SLEEP_UNSUPPORTED = ("vLLM cannot sleep on this platform (vLLM on CPU refuses "
                     "--enable-sleep-mode: \"Sleep mode is not supported on current platform\")")


class VllmAdapter:
    kind = "vllm"

    def __init__(self, session: aiohttp.ClientSession, host: str, port: int,
                 sleep_mode: bool = True) -> None:
        self._client = EngineClient(session, host, port)
        self._sleep_mode = sleep_mode

    def command(self, record: EngineRecord, ctx: LaunchContext) -> tuple[list[str], dict[str, str]]:
        spec = record.spec
        argv = build_argv(ctx.command, spec.artifact_url, spec.model_name, ctx.bind_host,
                          record.port, spec.args, sleep_mode=self._sleep_mode)
        return argv, build_env(ctx.base_env, ctx.extra_env)

    def sleep_unsupported(self) -> str | None:
        return None if self._sleep_mode else SLEEP_UNSUPPORTED

    async def healthy(self, timeout_s: float) -> bool:
        return await self._client.health(timeout_s)

    async def prepare(self, timeout_s: float) -> None:
        return None

    async def is_sleeping(self, timeout_s: float) -> bool | None:
        if not self._sleep_mode:
            return False
        return await self._client.is_sleeping(timeout_s)

    async def sleep(self, level: int, timeout_s: float) -> None:
        await self._client.post(f"/sleep?level={level}", timeout_s)

    async def wake(self, from_level: int, timeout_s: float) -> None:
        if from_level == 2:
            await self._client.post("/wake_up?tags=weights", timeout_s)
            await self._client.post("/collective_rpc", timeout_s, {"method": "reload_weights"})
            await self._client.post("/wake_up?tags=kv_cache", timeout_s)
        else:
            await self._client.post("/wake_up", timeout_s)

    async def observe(self, timeout_s: float) -> Observation | None:
        figures = await self._client.request_figures(timeout_s)
        if figures is None:
            return None
        return Observation(running=figures.running, waiting=figures.waiting,
                           success_total=figures.success_total)

    async def close(self) -> None:
        return None

