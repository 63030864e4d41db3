"""A strict typed decoder for the AIBrix wire, in Python: the field table of aibrix-wire.md.

JSON Schema counts ``1.0`` as an integer, so a schema check alone misses the bug that broke
AIBrix's Go controller. This decoder reads the raw bytes with a ``parse_float`` hook, so every
number written with a fraction or an exponent is seen as such, and then checks each field the
way Go's ``encoding/json`` decodes it into the controller's structs: an integer field takes
only an integer literal within its range, a bool only true/false, a string only a string, a
time only RFC 3339; ``null`` is allowed where Go leaves a zero value (and for pointers).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any


class Fraction(float):
    """A JSON number that was written with a fraction or an exponent."""


_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
_RANGES = {"int32": 2**31, "int64": 2**63, "int": 2**63}

# field -> (type, may be absent). Types: int32, int64, int, bool, string, time, claim_ref, list.
CLAIM_REF = {"namespace": ("string", False), "name": ("string", False), "uid": ("string", False)}
ACTIVATE = {"status": ("string", False), "model_name": ("string", False),
            "port": ("int32", False), "ipc_name": ("string", False),
            "message": ("string", True)}
OPERATION = {"status": ("string", False), "model_name": ("string", False),
             "operation_id": ("string", False), "applied": ("bool", False),
             "phase": ("string", False)}
MODEL_INFO = {"model_name": ("string", False), "port": ("int32", False),
              "ipc_name": ("string", False), "phase": ("string", False),
              "ready": ("bool", False), "kv_used_bytes": ("int64", True),
              "kv_total_bytes": ("int64", True)}
ACCELERATOR = {"id": ("string", False), "hbm_total_bytes": ("int64", False),
               "hbm_free_bytes": ("int64", False), "hbm_usable_bytes": ("int64", True)}
SNAPSHOT_MODEL = {
    "model_name": ("string", False), "artifact_url": ("string", False),
    "claim_ref": ("claim_ref", True), "port": ("int32", False), "ipc_name": ("string", False),
    "phase": ("string", False), "alive": ("bool", False), "ready": ("bool", False),
    "restart_count": ("int", False), "last_error": ("string", True),
    "last_transition": ("time", True), "kv_used_bytes": ("int64", False),
    "kv_capacity_bytes": ("int64", False), "hbm_peak_bytes": ("int64", False),
    "request_metrics_observed": ("bool", False), "requests_running": ("int64", False),
    "requests_waiting": ("int64", False), "request_success_total": ("int64", True)}
# What the controller's fields hold null for without harm: Go leaves the zero value.
_NULL_OK = {"kv_used_bytes", "kv_capacity_bytes", "hbm_peak_bytes", "hbm_usable_bytes",
            "last_error", "claim_ref", "last_transition", "request_success_total", "message"}


class WireError(ValueError):
    """The body would not decode into the controller's struct; says where and why."""


def loads(raw: bytes | str) -> Any:
    """JSON with every fraction-or-exponent number kept as a ``Fraction``."""
    return json.loads(raw, parse_float=Fraction)


def _check(value: Any, kind: str, where: str) -> None:
    if kind in _RANGES:
        if isinstance(value, Fraction):
            raise WireError(f"{where}: {value!r} is written with a fraction; Go's {kind} refuses it")
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(f"{where}: {value!r} is not a JSON integer ({kind})")
        if not -_RANGES[kind] <= value < _RANGES[kind]:
            raise WireError(f"{where}: {value} overflows {kind}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise WireError(f"{where}: {value!r} is not a JSON bool")
    elif kind == "string":
        if not isinstance(value, str):
            raise WireError(f"{where}: {value!r} is not a JSON string")
    elif kind == "time":
        if not isinstance(value, str) or not _RFC3339.match(value):
            raise WireError(f"{where}: {value!r} is not an RFC 3339 time")
    elif kind == "claim_ref":
        check_object(value, CLAIM_REF, where)
    else:  # pragma: no cover - a table typo
        raise AssertionError(f"unknown kind {kind}")


def check_object(obj: Any, table: Mapping[str, tuple[str, bool]], where: str = "body") -> None:
    if not isinstance(obj, dict):
        raise WireError(f"{where}: not a JSON object")
    for field, (kind, may_be_absent) in table.items():
        if field not in obj:
            if not may_be_absent:
                raise WireError(f"{where}.{field}: missing (Go would read its zero value)")
            continue
        value = obj[field]
        if value is None:
            if field in _NULL_OK:
                continue
            raise WireError(f"{where}.{field}: null where the controller needs a {kind}")
        _check(value, kind, f"{where}.{field}")


def check(kind: str, raw: bytes | str) -> Any:
    """Decode ``raw`` as the controller decodes a ``kind`` answer; the parsed body, or raise."""
    body = loads(raw)
    if kind == "activate":
        check_object(body, ACTIVATE)
    elif kind == "operation":
        check_object(body, OPERATION)
    elif kind == "models":
        if not isinstance(body, dict) or not isinstance(body.get("models"), list):
            raise WireError("body.models: not a list")
        for i, entry in enumerate(body["models"]):
            check_object(entry, MODEL_INFO, f"models[{i}]")
    elif kind == "snapshot":
        check_object(body, {"observed_at": ("time", False)})
        for key in ("accelerators", "models", "cached_artifacts"):
            if not isinstance(body.get(key), list):
                raise WireError(f"body.{key}: not a list")
        for i, acc in enumerate(body["accelerators"]):
            check_object(acc, ACCELERATOR, f"accelerators[{i}]")
        for i, model in enumerate(body["models"]):
            check_object(model, SNAPSHOT_MODEL, f"models[{i}]")
        for i, url in enumerate(body["cached_artifacts"]):
            _check(url, "string", f"cached_artifacts[{i}]")
    else:
        raise ValueError(f"unknown kind {kind}")
    return body
