"""The SGLang engine kind: command line and SGLang's own HTTP API for the supervisor.

SGLang (``python -m sglang.launch_server``) sleeps through its memory-saver endpoints:
``POST /release_memory_occupation`` frees the GPU memory of the weights, the KV cache and the
CUDA graphs, and ``POST /resume_memory_occupation`` maps it again. Both need a JSON body (``{}``
at least) and answer 200 with ``null``. The agent starts SGLang with ``--enable-memory-saver``
(without it a release frees nothing) and ``--enable-weights-cpu-backup`` (without it the weights
are lost on release and the engine would serve garbage after a resume), so every SGLang sleep
keeps the weights in host memory: a level-2 sleep is a level-1 sleep here.

SGLang has no endpoint that says whether it is released, so the agent's own record is the word
on sleep. Its ``/health`` runs a one-token generation, which on a released engine hangs until
SGLang's health timeout; the agent probes ``/health`` only while the engine is awake and
``/ready`` (no GPU work) while it sleeps. Releasing while requests run brings SGLang's whole
server down, so a sleep is refused while its figures show requests in flight. Request figures
come from ``--enable-metrics``: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs`` and
``sglang:num_requests_total`` (SGLang counts finished requests, aborted ones too; it has no
success counter).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING


from contract.engines import model_argument
from engine_http.upstream import Upstream
from engines.driver import LaunchContext, Observation, adapters_from_cards
from engines.client import EngineCallError, EngineClient

if TYPE_CHECKING:
    from registry.record import EngineRecord

SGLANG_FIGURES: Mapping[str, str] = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_requests_total": "success_total",
}
AGENT_FLAGS = ("--enable-memory-saver", "--enable-weights-cpu-backup", "--enable-metrics")
# The agent's probes and scrapes stay out of SGLang's access log (prefixes; see engines.vllm).
QUIET_PREFIXES = ("/health", "/ready", "/metrics")
ACCESS_LOG_FLAG = "--uvicorn-access-log-exclude-prefixes"


def build_argv(command: Sequence[str], artifact_url: str, served_name: str, host: str,
               port: int, args: Mapping[str, str]) -> list[str]:
    argv = [*command, "--model-path", model_argument(artifact_url),
            "--served-model-name", served_name, "--host", host, "--port", str(port),
            *AGENT_FLAGS]
    if not any(flag.replace("_", "-") == ACCESS_LOG_FLAG for flag in args):
        argv += [ACCESS_LOG_FLAG, *QUIET_PREFIXES]
    for flag, value in args.items():
        argv.append(flag)
        if value != "":
            argv.append(value)
    return argv


class SglangDriver:
    kind = "sglang"

    def __init__(self, http: Upstream, host: str, port: int) -> None:
        self._client = EngineClient(http, host, port)

    def command(self, record: EngineRecord, ctx: LaunchContext) -> tuple[list[str], dict[str, str]]:
        spec = record.spec
        prefix = [*ctx.command, "--sim-mode", "sglang"] if ctx.simulated else list(ctx.command)
        argv = build_argv(prefix, spec.artifact_url, spec.model_name, ctx.bind_host,
                          record.port, spec.args)
        env = dict(ctx.base_env)
        env.update(ctx.extra_env)
        return argv, env

    def sleep_unsupported(self) -> str | None:
        return None

    async def healthy(self, timeout_s: float, asleep: bool = False) -> bool:
        # /health generates a token: it would hang on a released engine.
        return await self._client.health(timeout_s, "/ready" if asleep else "/health")

    async def probe(self, timeout_s: float, asleep: bool) -> tuple[bool, bool | None]:
        return await self.healthy(timeout_s, asleep), None

    async def prepare(self, timeout_s: float) -> bool:
        return False

    async def is_sleeping(self, timeout_s: float) -> bool | None:
        return None  # SGLang does not say; the agent's record does

    async def sleep(self, level: int, timeout_s: float) -> None:
        figures = await self._client.request_figures(min(timeout_s, 5.0), SGLANG_FIGURES)
        if figures is not None and (figures.running or figures.waiting):
            raise EngineCallError(
                f"SGLang has {figures.running} request(s) running and {figures.waiting} waiting; "
                "releasing its memory now would bring its server down, so it stays awake")
        await self._client.post("/release_memory_occupation", timeout_s, {})

    async def wake(self, from_level: int, timeout_s: float) -> None:
        await self._client.post("/resume_memory_occupation", timeout_s, {})

    async def observe(self, timeout_s: float) -> Observation | None:
        figures = await self._client.request_figures(timeout_s, SGLANG_FIGURES)
        if figures is None:
            return None
        return Observation(running=figures.running, waiting=figures.waiting,
                           success_total=figures.success_total)

    async def load_adapter(self, name: str, path: str, timeout_s: float) -> None:
        await self._lora("/load_lora_adapter", {"lora_name": name, "lora_path": path},
                         timeout_s)

    async def unload_adapter(self, name: str, timeout_s: float) -> None:
        await self._lora("/unload_lora_adapter", {"lora_name": name}, timeout_s)

    async def _lora(self, path: str, body: dict[str, str], timeout_s: float) -> None:
        """SGLang answers ``{"success", "error_message"}``, 400 when it did not."""
        try:
            await self._client.post(path, timeout_s, body)
        except EngineCallError as exc:
            raise EngineCallError(_sglang_error(str(exc)), exc.status) from exc

    async def loaded_adapters(self, timeout_s: float) -> dict[str, str] | None:
        return adapters_from_cards(await self._client.served_models(timeout_s))

    async def close(self) -> None:
        return None


def _sglang_error(message: str) -> str:
    """The ``error_message`` of SGLang's LoRA answer inside an EngineCallError's text."""
    _, _, body = message.partition(": ")
    try:
        found = json.loads(body).get("error_message")
    except (ValueError, AttributeError):
        return message
    return str(found) if found else message
