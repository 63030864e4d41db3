"""A model's GPU figures estimated from its artifact, before anything runs: weights, KV floor
and footprint, each with what it came from.

The seed's rule is "observed first, declared second"; before the first observation, a claim
without ``perGPU`` needs a number, and the artifact has one: its weights' header says how many
parameters of each dtype it holds, and its ``config.json`` the attention shape the KV cache
follows. This module is pure (decoded JSON and figures in, an ``Estimate`` out); reading a
directory is ``contract.footprint.reading``'s.

Rules, each with the mistake it avoids:

* Hostile input never raises anything but ``FootprintError`` ("cannot estimate: <why>"): a
  config is JSON from anywhere, so every field is checked for its type and range (a bool is
  not a count, ``1e400`` is not a length, ``10**30`` layers is refused rather than believed).
* Weights are what the engine holds, not what the file stores: vLLM's ``--dtype auto`` runs a
  float32 checkpoint in 16 bits (``_resolve_auto_dtype``), so a float32 file counts 2 bytes a
  parameter unless ``--dtype float32`` says otherwise. Integer and 8-bit tensors (buffers such
  as ``position_ids``, packed weights) count as stored, and so does every tensor of a quantized
  checkpoint (a ``quantization_config``): its dtypes are the quantizer's, not the engine's.
* The KV floor is the seed's formula, 2 x layers x KV heads x head size x bytes per value x the
  maximum length; ``num_key_value_heads`` absent is multi-head attention (the attention heads),
  ``head_dim`` absent is ``hidden_size / num_attention_heads``; a multimodal config's
  language model is its ``text_config`` (``llm_config``, ``language_config``). MLA models
  (``kv_lora_rank``) cache one latent of ``kv_lora_rank + qk_rope_head_dim`` per layer instead.
* The footprint besides the KV cache is the weights plus a written-down allowance for what a
  running engine adds (CUDA context, cuBLAS workspaces, activations, CUDA graphs, the
  allocator's slack): ``RUNTIME_ALLOWANCE`` plus ``ACTIVATION_SHARE`` of the weights. It is an
  estimate, marked as one, and the figure measured once the engine runs replaces it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

MiB = 1 << 20
RUNTIME_ALLOWANCE = 768 * MiB  # CUDA context + cuBLAS/NCCL workspaces + allocator slack
ACTIVATION_SHARE = 0.10  # activations and CUDA graphs, as a share of the weights
MAX_COUNT = 1 << 40  # no layer count, head count, width or length is this large

# Bytes per value of each safetensors dtype (the format's list); F4/packed types are 1 byte per
# stored element here, since their stored bytes are counted as stored.
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4,
               "F16": 2, "BF16": 2, "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}
FLOATS = frozenset({"F64", "F32", "F16", "BF16"})
# torch / vLLM dtype names (config's torch_dtype or dtype, --dtype, --kv-cache-dtype).
_NAMED_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2,
                "bfloat16": 2, "bf16": 2, "float64": 8, "double": 8}
_TEXT_CONFIGS = ("text_config", "llm_config", "language_config")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_HEADS = ("num_attention_heads", "n_head")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_LENGTHS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_READABLE_INT = re.compile(r"^(?P<n>\d{1,15}(?:\.\d{1,6})?)(?P<unit>[kKmMgG]?)$")


class FootprintError(ValueError):
    """The artifact cannot be estimated; ``str()`` says why, as "cannot estimate: <why>"."""

    def __init__(self, why: str) -> None:
        super().__init__(f"cannot estimate: {why}")


@dataclass(frozen=True)
class Weights:
    """What the weight files hold: parameters and stored bytes per safetensors dtype."""

    params_by_dtype: Mapping[str, int]
    bytes_by_dtype: Mapping[str, int]
    source: str  # "safetensors headers (2 files)", "model.safetensors.index.json ...", ...

    @property
    def stored_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())


@dataclass(frozen=True)
class Figure:
    """One figure in bytes and what it came from, in words."""

    bytes: int
    source: str


@dataclass(frozen=True)
class Estimate:
    """The artifact's figures. ``footprint`` is the seed's maximumFootprint (everything one
    instance holds on a GPU apart from its KV cache); ``room`` is what placement looks for."""

    weights: Figure
    kv_floor: Figure
    footprint: Figure
    stored_bytes: int
    inputs: Mapping[str, str] = field(default_factory=dict)  # each input and where it was read

    @property
    def room(self) -> int:
        return self.footprint.bytes + self.kv_floor.bytes

    def as_json(self) -> dict[str, object]:
        return {"weightsBytes": self.weights.bytes, "kvFloorBytes": self.kv_floor.bytes,
                "footprintBytes": self.footprint.bytes, "roomBytes": self.room,
                "storedBytes": self.stored_bytes, "estimated": True,
                "sources": {"weights": self.weights.source, "kvFloor": self.kv_floor.source,
                            "footprint": self.footprint.source},
                "inputs": dict(self.inputs)}


def count(value: object) -> int | None:
    """A positive whole number under ``MAX_COUNT`` from JSON (``2.0`` is 2), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 < value < MAX_COUNT:
        return value
    return None


def readable_int(text: str) -> int | None:
    """vLLM's human-readable integers for ``--max-model-len``: ``4096``, ``32k`` (x1000),
    ``32K`` (x1024), ``1m``/``1M``, ``1.5k``; None for anything else (``-1``, ``auto``)."""
    match = _READABLE_INT.fullmatch(text.strip())
    if match is None:
        return None
    unit = match["unit"]
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9,
             "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit]
    value = float(match["n"]) * scale
    return count(value) if value.is_integer() else None


def _language_model(config: Mapping[str, object]) -> tuple[Mapping[str, object], str]:
    for name in _TEXT_CONFIGS:
        inner = config.get(name)
        if isinstance(inner, Mapping) and any(k in inner for k in _LAYERS):
            return {**config, **inner}, f"{name}."
    return config, ""


def _field(lm: Mapping[str, object], names: tuple[str, ...], prefix: str,
           inputs: dict[str, str], label: str) -> int | None:
    for name in names:
        if name in lm:
            value = count(lm[name])
            if value is None:
                raise FootprintError(f"config.json {prefix}{name} must be a positive whole "
                                     f"number, got {_shown(lm[name])}")
            inputs[label] = f"{value} (config.json {prefix}{name})"
            return value
    return None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _dtype_bytes(name: object) -> int | None:
    return _NAMED_BYTES.get(name.lower()) if isinstance(name, str) else None


def _model_dtype(lm: Mapping[str, object], weights: Weights,
                 args: Mapping[str, str]) -> tuple[int, str]:
    """Bytes per value the engine computes in: ``--dtype``, else config's ``torch_dtype`` (or
    ``dtype``), else the most common stored float dtype; 32 bits under ``--dtype auto`` run in
    16 (vLLM's ``_resolve_auto_dtype``)."""
    flag = args.get("--dtype", "auto")
    if flag != "auto":
        size = _dtype_bytes(flag)
        if size is None:
            raise FootprintError(f"--dtype {_shown(flag)} is not a dtype this estimate knows")
        return size, f"--dtype {flag}"
    for name in ("torch_dtype", "dtype"):
        size = _dtype_bytes(lm.get(name))
        if size is not None:
            why = f"config.json {name} {lm[name]}"
            break
    else:
        floats = {d: n for d, n in weights.params_by_dtype.items() if d in FLOATS}
        stored = max(floats, key=lambda d: floats[d], default=None)
        if stored is None:
            return 2, "no float tensors: 16 bits assumed"
        size, why = DTYPE_BYTES[stored], f"stored {stored}"
    if size > 2:
        return 2, f"{why}, run in 16 bits by --dtype auto"
    return size, why


def _weights(weights: Weights, lm: Mapping[str, object], dtype: tuple[int, str]) -> Figure:
    """The bytes the engine holds: float tensors at the engine's dtype, the rest as stored."""
    if not weights.params_by_dtype:
        return Figure(weights.stored_bytes, f"{weights.source}, as stored (no parameter "
                      "counts: the dtype the engine runs in is not applied)")
    if "quantization_config" in lm or "compression_config" in lm:
        return Figure(weights.stored_bytes, f"{weights.source}, as stored (quantized)")
    size, why = dtype
    params = sum(n for d, n in weights.params_by_dtype.items() if d in FLOATS)
    other = sum(b for d, b in weights.bytes_by_dtype.items() if d not in FLOATS)
    kept = f" + {other:,} bytes of other tensors as stored" if other else ""
    return Figure(params * size + other, f"{params:,} float parameters x {size} bytes ({why})"
                  f"{kept}, from {weights.source}")


def _kv_bytes(args: Mapping[str, str], weights_dtype_bytes: int) -> tuple[int, str]:
    flag = args.get("--kv-cache-dtype", "auto")
    if flag == "auto":
        return weights_dtype_bytes, "the model's dtype (--kv-cache-dtype auto)"
    if flag.lower().startswith("fp8"):
        return 1, f"--kv-cache-dtype {flag}"
    size = _dtype_bytes(flag)
    if size is None:
        raise FootprintError(f"--kv-cache-dtype {_shown(flag)} is not a dtype this estimate "
                             "knows")
    return size, f"--kv-cache-dtype {flag}"


def _max_length(lm: Mapping[str, object], prefix: str, args: Mapping[str, str],
                inputs: dict[str, str]) -> int:
    for flag in ("--max-model-len", "--max_model_len"):
        if flag in args:
            length = readable_int(args[flag])
            if length is None:
                raise FootprintError(f"{flag} {_shown(args[flag])} is not a length; write a "
                                     "number of tokens such as 4096 or 32k")
            inputs["maxLength"] = f"{length} ({flag})"
            return length
    length = _field(lm, _LENGTHS, prefix, inputs, "maxLength")
    if length is None:
        raise FootprintError("config.json names no maximum length (max_position_embeddings); "
                             "give --max-model-len")
    return length


def estimate(config: object, weights: Weights, args: Mapping[str, str]) -> Estimate:
    """The figures for ``config`` (decoded ``config.json``) and ``weights`` under the engine
    arguments ``args`` (flag -> value, as a claim's ``engineConfig.args``)."""
    if not isinstance(config, Mapping):
        raise FootprintError("config.json is not a JSON object")
    if not weights.params_by_dtype and not weights.bytes_by_dtype:
        raise FootprintError(f"the weights hold no tensors ({weights.source})")
    lm, prefix = _language_model(config)
    inputs: dict[str, str] = {}
    dtype = _model_dtype(lm, weights, args)
    inputs["dtype"] = f"{dtype[0]} bytes ({dtype[1]})"
    held = _weights(weights, lm, dtype)
    layers = _field(lm, _LAYERS, prefix, inputs, "layers")
    if layers is None:
        raise FootprintError("config.json names no layer count (num_hidden_layers)")
    heads = _field(lm, _HEADS, prefix, inputs, "attentionHeads")
    length = _max_length(lm, prefix, args, inputs)
    kv_value, kv_why = _kv_bytes(args, dtype[0])
    inputs["kvBytesPerValue"] = f"{kv_value} ({kv_why})"
    lora = _field(lm, ("kv_lora_rank",), prefix, inputs, "kvLoraRank")
    if lora is not None:
        rope = _field(lm, ("qk_rope_head_dim",), prefix, inputs, "ropeHeadDim") or 0
        per_token = layers * (lora + rope) * kv_value
        formula = f"{layers} layers x ({lora} + {rope}) latent x {kv_value} bytes x {length}"
    else:
        if heads is None:
            raise FootprintError("config.json names no attention head count "
                                 "(num_attention_heads)")
        kv_heads = _field(lm, _KV_HEADS, prefix, inputs, "kvHeads")
        if kv_heads is None:
            kv_heads = heads
            inputs["kvHeads"] = f"{heads} (no num_key_value_heads: the attention heads)"
        head_dim = _field(lm, ("head_dim",), prefix, inputs, "headDim")
        if head_dim is None:
            hidden = _field(lm, _HIDDEN, prefix, inputs, "hiddenSize")
            if hidden is None:
                raise FootprintError("config.json names neither head_dim nor hidden_size")
            head_dim = max(1, hidden // heads)
            inputs["headDim"] = f"{head_dim} (hidden_size {hidden} / {heads} heads)"
        per_token = 2 * layers * kv_heads * head_dim * kv_value
        formula = (f"2 x {layers} layers x {kv_heads} KV heads x {head_dim} head size x "
                   f"{kv_value} bytes x {length}")
    kv_floor = Figure(per_token * length, f"{formula} tokens (the seed's KV floor)")
    overhead = RUNTIME_ALLOWANCE + math.ceil(held.bytes * ACTIVATION_SHARE)
    footprint = Figure(held.bytes + overhead,
                       f"weights + {RUNTIME_ALLOWANCE // MiB} MiB runtime allowance + "
                       f"{ACTIVATION_SHARE:.0%} of the weights for activations and CUDA graphs")
    return Estimate(held, kv_floor, footprint, weights.stored_bytes, inputs)
