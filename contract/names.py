"""Names that become file names, IPC names and engine arguments: one rule for agent and reconciler.

Model names reach a file system (logs), an engine's command line (``--served-model-name``) and
shared memory (the kvcached segment), so they are checked here, once, with the same rule on
both sides. IPC names follow kvcached: every character outside ``[A-Za-z0-9_-]`` becomes ``-``,
because kvcached rewrites a segment name the same way and the two must agree.

Every name pattern here and elsewhere is applied with ``fullmatch``: Python's ``$`` also matches
before a final newline, so ``.match`` with ``^...$`` once took ``"cxa\n"`` as a model name (listed
beside ``cxa``, exported as a metric label). Pydantic's ``pattern=`` (Rust's regex) and
Kubernetes' (Go's RE2) read ``$`` as the end of the text, so the same pattern is exact there.
"""

from __future__ import annotations

import re

MAX_MODEL_NAME = 128
MAX_IPC_NAME = 64
# What a caller may send as an ipc_name before it is sanitised: a file name's limit.
MAX_IPC_NAME_SENT = 255
IPC_PREFIX = "kvc_"  # the AIBrix sidecar's default segment name is kvc_<model>

# Model names as clients send them: "qwen3-0.6b", "Qwen/Qwen3-0.6B", "qwen3:32b", "llama@v2".
# The ModelClaim CRD writes the same pattern and bound (tests/test_claim_schema.py compares).
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"
_MODEL_NAME = re.compile(MODEL_NAME_PATTERN)
_IPC_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def model_name_problem(name: object, field: str = "model_name") -> str | None:
    """Why ``name`` cannot be a model name, or None when it can."""
    if not isinstance(name, str) or not name:
        return f"{field} must be a non-empty string"
    if len(name) > MAX_MODEL_NAME:
        return f"{field} is {len(name)} characters long; the limit is {MAX_MODEL_NAME}"
    if not _MODEL_NAME.fullmatch(name):
        return (f"{field} may contain only letters, digits and . _ : / @ + -, "
                f"and must start with a letter or digit: {name!r}")
    if ".." in name or "//" in name or name.endswith("/"):
        return f"{field} must not contain '..' or '//' or end with '/': {name!r}"
    return None


def sanitise_ipc_name(name: str) -> str:
    """kvcached's rule: characters outside [A-Za-z0-9_-] become '-'; at most 64 characters."""
    return _IPC_UNSAFE.sub("-", name)[:MAX_IPC_NAME]


def ipc_name_for(model_name: str) -> str:
    """The default segment name of a model, as the AIBrix sidecar derives it: ``kvc_<model>``."""
    return sanitise_ipc_name(IPC_PREFIX + model_name)


def ipc_name_problem(name: str) -> str | None:
    """Why ``name`` is not already a sanitised IPC name (as stored and used), or None."""
    if not name:
        return "ipc_name must not be empty"
    if len(name) > MAX_IPC_NAME or _IPC_UNSAFE.search(name):
        return f"ipc_name must be 1-{MAX_IPC_NAME} characters of [A-Za-z0-9_-]: {name!r}"
    return None


def sent_ipc_name_problem(name: str) -> str | None:
    """Why an ipc_name a caller sent cannot be sanitised into a segment name, or None.

    ``kvc_qwen3-0.6b`` is fine (it becomes ``kvc_qwen3-0-6b``); a name that is empty, made only
    of characters kvcached would replace, over a file name's length, or carrying control
    characters or a path is refused: it cannot be what the caller meant."""
    if not name:
        return "ipc_name must not be empty"
    if len(name) > MAX_IPC_NAME_SENT:
        return f"ipc_name is {len(name)} characters long; the limit is {MAX_IPC_NAME_SENT}"
    if any(not c.isprintable() for c in name):
        return "ipc_name must not contain control characters"
    if "/" in name or "\\" in name:
        return f"ipc_name must not contain a path separator: {name!r}"
    if not re.search(r"[A-Za-z0-9]", name):
        return f"ipc_name must contain a letter or digit: {name!r}"
    return None
