"""Names that become file names, IPC names and engine arguments: validated and normalised."""

from __future__ import annotations

import re

MAX_MODEL_NAME = 128
MAX_IPC_NAME = 64

# Model names as clients send them: "qwen3-0.6b", "Qwen/Qwen3-0.6B", "qwen3:32b", "llama@v2".
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")
_IPC_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def model_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a model name, or None when it can."""
    if not name:
        return "model_name must not be empty"
    if len(name) > MAX_MODEL_NAME:
        return f"model_name is {len(name)} characters long; the limit is {MAX_MODEL_NAME}"
    if not _MODEL_NAME.match(name):
        return (
            "model_name may contain only letters, digits and . _ : / @ + -, "
            f"and must start with a letter or digit: {name!r}"
        )
    if ".." in name or "//" in name or name.endswith("/"):
        return f"model_name must not contain '..' or '//' or end with '/': {name!r}"
    return None


def ipc_name_for(model_name: str) -> str:
    """kvcached's normalisation: characters outside [A-Za-z0-9_-] become '-', at most 64."""
    return _IPC_UNSAFE.sub("-", model_name)[:MAX_IPC_NAME]


def ipc_name_problem(name: str) -> str | None:
    if not name:
        return "ipc_name must not be empty"
    if len(name) > MAX_IPC_NAME or _IPC_UNSAFE.search(name):
        return f"ipc_name must be 1-{MAX_IPC_NAME} characters of [A-Za-z0-9_-]: {name!r}"
    return None
