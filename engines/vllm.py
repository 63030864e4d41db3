"""The vLLM engine kind: command line and vLLM's own HTTP API for the supervisor.

The simulated engine (``engines.sim``) accepts the same command line, so on a machine without a
GPU only the executable prefix changes. Flag values are separate argv items, never a shell.
Sleep state comes from ``/is_sleeping``, never from ``/health`` (200 while asleep). Waking
from a level-2 sleep (weights discarded) follows vLLM's documented sequence: reallocate the
weights, reload them in place, then reallocate the KV cache; a plain wake would serve with
garbage weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING


from contract.engines import lora_enabled, model_argument
from engine_http.upstream import Upstream
from engines.driver import LaunchContext, Observation, adapters_from_cards
from engines.client import EngineClient

if TYPE_CHECKING:
    from registry.record import EngineRecord

# The agent's own requests (readiness and health probes, metric scrapes) stay out of the engine's
# access log, so its log and the tail in last_error show what clients did. vLLM (0.16+) drops
# these exact paths; an activation that sets either access-log flag itself keeps its choice.
QUIET_PATHS = ("/health", "/is_sleeping", "/metrics")
ACCESS_LOG_FLAGS = ("--disable-access-log-for-endpoints", "--disable-uvicorn-access-log",
                    "--no-disable-uvicorn-access-log")


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
    if not any(flag.replace("_", "-") in ACCESS_LOG_FLAGS for flag in args):
        argv += ["--disable-access-log-for-endpoints", ",".join(QUIET_PATHS)]
    for flag, value in args.items():
        argv.append(flag)
        if value != "":
            argv.append(value)
    return argv


def build_env(base: Mapping[str, str], extra: Mapping[str, str],
              lora: bool = False) -> dict[str, str]:
    env = dict(base)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the sleep endpoints exist only in dev mode
    if lora:  # /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with this
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    env.update(extra)
    return env


SLEEP_UNSUPPORTED = ("vLLM cannot sleep on this platform (vLLM on CPU refuses "
                     "--enable-sleep-mode: \"Sleep mode is not supported on current platform\")")


class VllmDriver:
    kind = "vllm"

    def __init__(self, http: Upstream, host: str, port: int,
                 sleep_mode: bool = True) -> None:
        self._client = EngineClient(http, host, port)
        self._sleep_mode = sleep_mode

    def command(self, record: EngineRecord, ctx: LaunchContext) -> tuple[list[str], dict[str, str]]:
        spec = record.spec
        argv = build_argv(ctx.command, ctx.model_path or spec.artifact_url, spec.model_name,
                          ctx.bind_host,
                          record.port, spec.args, sleep_mode=self._sleep_mode)
        return argv, build_env(ctx.base_env, ctx.extra_env, lora_enabled(spec.engine, spec.args))

    def sleep_unsupported(self) -> str | None:
        return None if self._sleep_mode else SLEEP_UNSUPPORTED

    async def healthy(self, timeout_s: float, asleep: bool = False) -> bool:
        return await self._client.health(timeout_s)

    async def probe(self, timeout_s: float, asleep: bool) -> tuple[bool, bool | None]:
        if not self._sleep_mode:
            return await self._client.health(timeout_s), False
        # /is_sleeping asks the engine core, so an answer shows the core works, not only the
        # API server (vLLM's /health reads a flag the core may never set when it hangs).
        sleeping = await self._client.is_sleeping(timeout_s)
        return sleeping is not None, sleeping

    async def prepare(self, timeout_s: float) -> bool:
        return False

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
        figures, sleep_level = await self._client.metrics_page(timeout_s)
        if figures is None:
            return None if sleep_level is None else Observation(sleep_level=sleep_level)
        return Observation(running=figures.running, waiting=figures.waiting,
                           success_total=figures.success_total, sleep_level=sleep_level)

    async def load_adapter(self, name: str, path: str, timeout_s: float) -> None:
        await self._client.post("/v1/load_lora_adapter", timeout_s,
                                {"lora_name": name, "lora_path": path})

    async def unload_adapter(self, name: str, timeout_s: float) -> None:
        await self._client.post("/v1/unload_lora_adapter", timeout_s, {"lora_name": name})

    async def loaded_adapters(self, timeout_s: float) -> dict[str, str] | None:
        return adapters_from_cards(await self._client.served_models(timeout_s))

    async def close(self) -> None:
        return None

