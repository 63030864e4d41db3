"""Runtime LoRA adapters of the simulated engine, as vLLM and SGLang load and unload them.

vLLM (0.10+): ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` exist only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set to 1 or true; success is 200 with a plain-text line, a
duplicate name is 400, a path with no adapter 404, errors in vLLM's nested error document.
SGLang: ``POST /load_lora_adapter`` and ``/unload_lora_adapter`` answer
``{"success", "error_message", "loaded_adapters"}`` with 200 on success and 400 otherwise. Both
need LoRA enabled at start (``--enable-lora``). A loaded adapter is served under its name and
listed by ``/v1/models`` with ``parent`` the base model. A ``lora_path`` is a local directory
(it must exist) or a Hugging Face repo id (taken as found: the simulator downloads nothing).
"""

from __future__ import annotations

import json
import os
from typing import Any

from aiohttp import web

from engines.sim import logs
from engines.sim.openai_api import STATE_KEY, error_response


def runtime_updates_allowed(value: str | None) -> bool:
    """vLLM reads ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` as ``value.strip().lower() in (1, true)``."""
    return (value or "").strip().lower() in ("1", "true")


def _path_problem(path: str) -> str | None:
    if path.startswith(("/", "./", "../")) and not os.path.isdir(path):
        return f"No adapter found for {path}"
    return None


async def _body(request: web.Request) -> dict[str, Any] | None:
    try:
        body = json.loads(await request.read())
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


# ---- vLLM ---------------------------------------------------------------------------------------


async def vllm_load(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _body(request)
    name = str((body or {}).get("lora_name") or "")
    path = str((body or {}).get("lora_path") or "")
    if not name or not path:
        return error_response(400, "Both 'lora_name' and 'lora_path' must be provided.",
                              "InvalidUserInput")
    if not state.options.enable_lora:
        return error_response(400, "LoRA is not enabled; start vLLM with --enable-lora.",
                              "InvalidUserInput")
    if name in state.options.served_model_names:
        return error_response(400, f"The lora adapter '{name}' cannot share the base model's "
                              "name.", "InvalidUserInput")
    if name in state.lora_adapters and not (body or {}).get("load_inplace"):
        return error_response(400, f"The lora adapter '{name}' has already been loaded. If you "
                              "want to load the adapter in place, set 'load_inplace' to True.",
                              "InvalidUserInput")
    if (problem := _path_problem(path)) is not None:
        return error_response(404, f"Loading lora {name} failed: {problem}", "NotFoundError")
    state.lora_adapters[name] = path
    logs.engine_log("INFO", f"Loaded new LoRA adapter: name '{name}', path '{path}'",
                    "serving_models.py")
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def vllm_unload(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    name = str((await _body(request) or {}).get("lora_name") or "")
    if not name:
        return error_response(400, "'lora_name' must be provided.", "InvalidUserInput")
    if state.lora_adapters.pop(name, None) is None:
        return error_response(404, f"The lora adapter '{name}' cannot be found.",
                              "NotFoundError")
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


# ---- SGLang -------------------------------------------------------------------------------------


def _sglang_answer(state: Any, error: str | None) -> web.Response:
    body = {"rid": None, "http_worker_ipc": None, "success": error is None,
            "error_message": error, "loaded_adapters": dict(state.lora_adapters)}
    return web.json_response(body, status=200 if error is None else 400)


async def sglang_load(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await _body(request)
    if body is None or "lora_name" not in body or "lora_path" not in body:
        return web.json_response({"detail": [{"type": "missing", "loc": ["body"],
                                              "msg": "Field required", "input": None}]},
                                 status=422)
    name, path = str(body["lora_name"]), str(body["lora_path"])
    if not state.options.enable_lora:
        return _sglang_answer(state, "LoRA is not enabled. Please set `--enable-lora` to enable "
                              "LoRA.")
    if name in state.lora_adapters:
        return _sglang_answer(state, f"Failed to load LoRA adapter {name} because it is already "
                              "loaded")
    if (problem := _path_problem(path)) is not None:
        return _sglang_answer(state, problem)
    state.lora_adapters[name] = path
    return _sglang_answer(state, None)


async def sglang_unload(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    name = str((await _body(request) or {}).get("lora_name") or "")
    if state.lora_adapters.pop(name, None) is None:
        loaded = ", ".join(state.lora_adapters) or "none"
        return _sglang_answer(state, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                              f"{loaded}")
    return _sglang_answer(state, None)


def adapter_cards(state: Any, created: int, owned_by: str) -> list[dict[str, Any]]:
    """The ``/v1/models`` cards of the loaded adapters: ``parent`` is the base model."""
    return [{"id": name, "object": "model", "created": created, "owned_by": owned_by,
             "root": path, "parent": state.options.served_model_name, "max_model_len": None}
            for name, path in state.lora_adapters.items()]
