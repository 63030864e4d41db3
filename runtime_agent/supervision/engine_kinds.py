"""Engine kinds as the agent sees them: which driver runs an engine, how it is started, and
what makes an activation invalid for its kind.

The agent-side identity (engine id, state directory, spec) and the kvcached settings go into
every engine's environment here, whatever its kind, so re-adoption works for all of them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from contract.engines import (
    artifact_problem,
    device_count_problem,
    engine_args_problem,
    is_local_artifact,
    model_argument,
)
from contract.engines import gpus_needed as contract_gpus_needed
from engine_http.upstream import Upstream
from engines import sglang, vllm
from engines.driver import EngineDriver, LaunchContext
from registry.env import ENV_ENGINE_ID, ENV_ENGINE_SPEC, ENV_STATE_DIR
from runtime_agent.artifacts.urls import local_path_problem
from runtime_agent.settings import Settings

if TYPE_CHECKING:
    from registry.record import EngineRecord, EngineSpec

# Schemes engines cannot fetch themselves; the weight cache stages them before the start.
STAGED_SCHEMES = ("s3://",)


def simulated(settings: Settings, spec: EngineSpec) -> bool:
    return spec.engine == "sim" or settings.simulate_engines


def spec_problem(settings: Settings, spec: EngineSpec, device_count: int) -> str | None:
    """Why this activation cannot run here (reason InvalidEngineConfig), or None.

    The rules on the text are the contract's (the reconciler applies the same ones); what only
    this node can answer (does a local path exist, do the cards suffice) is checked here."""
    staged = STAGED_SCHEMES if settings.weight_cache_dir is not None else ()
    problem = (artifact_problem(spec.engine, spec.artifact_url, staged)
               or engine_args_problem(spec.engine, spec.args, simulated=simulated(settings, spec),
                                      allow_trust_remote_code=settings.allow_trust_remote_code)
               or device_count_problem(spec.engine, spec.args, device_count))
    if problem is None and spec.engine != "ollama" and is_local_artifact(spec.artifact_url):
        # Only inside the operator's roots, and a refusal says nothing of what lies outside.
        found = local_path_problem(model_argument(spec.artifact_url),
                                   settings.artifact_local_roots)
        return None if found is None else found[1]
    return problem


# ---- is the real engine there? (issue 13: a missing executable is a 503, not a 500) -----------


def command_prefix(settings: Settings, kind: str) -> tuple[str, ...]:
    """The argv prefix that runs a real engine of ``kind`` (before its model and flags)."""
    return {"ollama": settings.ollama_command,
            "sglang": settings.sglang_command}.get(kind, settings.vllm_command)


def executable_problem(settings: Settings, kind: str,
                       which: Callable[[str], str | None] = shutil.which) -> str | None:
    """Why a real engine of ``kind`` cannot be started here (its executable is not on PATH),
    or None. A PATH lookup: cheap enough for every activation, so an engine installed after
    the agent started is found."""
    command = command_prefix(settings, kind)
    if not command:
        return f"--{kind}-command is empty"
    if which(command[0]) is None:
        return f"{command[0]!r} (--{kind}-command) is not on PATH"
    return None


def engine_missing(settings: Settings, spec: EngineSpec,
                   which: Callable[[str], str | None] = shutil.which) -> str | None:
    """Why this activation's engine cannot start on this node (reason
    EngineExecutableMissing, a 503), or None. Simulated engines are always there; a
    ``python -m`` module was looked up once at start (``settings.engine_problems``)."""
    if simulated(settings, spec):
        return None
    problem = (executable_problem(settings, spec.engine, which)
               or dict(settings.engine_problems).get(spec.engine))
    if problem is None:
        return None
    return (f"engine {spec.engine!r} cannot run on this node: {problem}; install it (or set "
            f"--{spec.engine}-command) and activate again")


def gpus_needed(spec: EngineSpec) -> int:
    return contract_gpus_needed(spec.engine, spec.args)


def make_driver(settings: Settings, http: Upstream,
                 record: EngineRecord) -> EngineDriver:
    spec = record.spec
    host = settings.engine_probe_host
    if spec.engine == "ollama":
        from engines import ollama

        return ollama.OllamaDriver(http, host, record.port, spec.artifact_url)
    if spec.engine == "sglang":
        return sglang.SglangDriver(http, host, record.port)
    return vllm.VllmDriver(http, host, record.port, sleep_mode=settings.vllm_sleep_mode)


def carried_spec(record: EngineRecord) -> str:
    """The JSON an engine carries in its environment (see ``recovery.record_from_process``):
    credentials by name only; their values are the engine's own environment."""
    return json.dumps({
        "spec": msgspec.to_builtins(record.spec), "port": record.port,
        "devices": list(record.devices),
        "per_gpu": msgspec.to_builtins(record.per_gpu),
        "kv_limit_bytes": record.kv_limit_bytes, "desired": record.desired,
        "sleep_level": record.sleep_level, "credential_keys": sorted(record.credentials)})


def engine_command(settings: Settings, record: EngineRecord, driver: EngineDriver,
                   model_path: str | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and env; ``model_path``: the weight cache's copy to start on, in place of the
    artifact URL."""
    spec = record.spec
    sim = simulated(settings, spec)
    command = settings.sim_command if sim else command_prefix(settings, spec.engine)
    identity = {
        ENV_ENGINE_ID: record.engine_id,
        ENV_STATE_DIR: str(settings.state_dir),
        # The engine carries what a rebuild of its record needs, so it can be re-adopted with
        # its place, limits and sleep state even if its record file is lost.
        ENV_ENGINE_SPEC: carried_spec(record),
        # vLLM renames its processes with setproctitle, which can overwrite the environment
        # block /proc/<pid>/environ shows; this keeps the engine id readable for re-adoption.
        "SPT_NOENV": "1",
        "ENABLE_KVCACHED": "true",
        "KVCACHED_AUTOPATCH": "1",
        "KVCACHED_IPC_NAME": spec.ipc_name,
    }
    if record.devices:  # pinned to the cards admission chose, in NVML's (PCI bus) order
        identity["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        identity["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in record.devices)
    if settings.sim_gpu_dir is not None:  # simulated engines report their memory here
        identity["AIBRIX_SIM_GPU_DIR"] = str(settings.sim_gpu_dir.absolute())
    if str(settings.kv_shm_dir) != "/dev/shm":  # the simulated engine's knob; absolute, as
        # engines run in a directory of their own (ProcessLauncher)
        identity["KVCACHED_SHM_DIR"] = str(settings.kv_shm_dir.absolute())
    ctx = LaunchContext(command=command, simulated=sim, bind_host=settings.engine_bind_host,
                        base_env=os.environ,
                        extra_env={**settings.extra_engine_env, **record.credentials, **identity},
                        model_path=os.path.abspath(model_path) if model_path else None)
    return driver.command(record, ctx)
