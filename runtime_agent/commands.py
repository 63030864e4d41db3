"""The command line and environment an engine process is started with, per engine kind."""

from __future__ import annotations

import json
import os

from engines import vllm
from registry.record import ENV_ENGINE_ID, ENV_ENGINE_SPEC, ENV_STATE_DIR, EngineRecord
from runtime_agent.settings import Settings


def engine_command(settings: Settings, record: EngineRecord) -> tuple[list[str], dict[str, str]]:
    """argv and env for ``record``'s engine. Raises ValueError for a kind this agent can't run."""
    spec = record.spec
    if spec.engine == "ollama":
        raise ValueError("engine 'ollama' is not supported by this agent build yet")
    use_sim = spec.engine == "sim" or settings.simulate_engines
    command = settings.sim_command if use_sim else settings.vllm_command
    argv = vllm.build_argv(command, spec.artifact_url, spec.model_name,
                           settings.engine_bind_host, record.port, spec.args)
    identity = {
        ENV_ENGINE_ID: record.engine_id,
        ENV_STATE_DIR: str(settings.state_dir),
        # The engine carries its own spec, so it can be re-adopted even if its record is lost.
        ENV_ENGINE_SPEC: json.dumps({"spec": spec.model_dump(mode="json"), "port": record.port}),
        # vLLM renames its processes with setproctitle, which can overwrite the environment
        # block /proc/<pid>/environ shows; this keeps the engine id readable for re-adoption.
        "SPT_NOENV": "1",
        "ENABLE_KVCACHED": "true",
        "KVCACHED_AUTOPATCH": "1",
        "KVCACHED_IPC_NAME": spec.ipc_name,
    }
    if str(settings.kv_shm_dir) != "/dev/shm":
        identity["KVCACHED_SHM_DIR"] = str(settings.kv_shm_dir)  # the simulated engine's knob
    env = vllm.build_env(os.environ, {**settings.extra_engine_env, **identity})
    return argv, env
