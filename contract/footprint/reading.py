"""Read what ``contract.footprint.estimate`` needs from a model directory: its ``config.json``
and what its weight files hold.

The weights are read, best first, from

1. the safetensors headers (every shard the index names, or every ``*.safetensors`` beside
   the config), with ``huggingface_hub.parse_local_safetensors_file_metadata`` (the 8-byte
   length and JSON header of the format, read by the library that documents it; the header
   alone is read, never the tensors): parameters and stored bytes per dtype;
2. ``model.safetensors.index.json``'s ``metadata.total_size`` when its shards are not all
   there: stored bytes, no dtypes;
3. the sizes of the other weight files (``*.bin``, ``*.pt``, ``*.pth``): stored bytes.

Rules: the directory is not trusted. A file is read up to a bound (``MAX_JSON_BYTES``), a
shard the index names must be a plain file name in the directory (``../x`` is refused, not
followed), at most ``MAX_SHARDS`` files are read, and every failure is a ``FootprintError``
that names the file and what is wrong, never another exception.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from huggingface_hub import parse_local_safetensors_file_metadata
from huggingface_hub.errors import SafetensorsParsingError

from contract.engines import is_local_artifact, model_argument
from contract.footprint.estimate import Estimate, FootprintError, Weights, count, estimate

MAX_JSON_BYTES = 32 << 20  # far beyond any config or index (a 1T-parameter index is ~5 MiB)
MAX_SHARDS = 4096
INDEX = "model.safetensors.index.json"
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth")
# What the library may raise on a hostile header besides its own error (a header that is a
# list, a shape of strings, a nesting too deep for json).
_HEADER_ERRORS = (SafetensorsParsingError, OSError, ValueError, TypeError, KeyError,
                  IndexError, AttributeError, RecursionError, OverflowError)


def read_json(path: Path) -> object:
    """``path`` decoded, or a ``FootprintError`` naming it."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise FootprintError(f"{path.name} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_JSON_BYTES:
        raise FootprintError(f"{path.name} is larger than {MAX_JSON_BYTES >> 20} MiB")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise FootprintError(f"{path.name} is not JSON: {str(exc)[:80]}") from None


def _headers(directory: Path, names: list[str], source: str) -> Weights:
    params: dict[str, int] = {}
    stored: dict[str, int] = {}
    for name in names:
        try:
            header = parse_local_safetensors_file_metadata(directory / name)
            tensors = list(header.tensors.values())
        except _HEADER_ERRORS as exc:
            raise FootprintError(f"{name} has no readable safetensors header: "
                                 f"{str(exc)[:120]}") from None
        for tensor in tensors:
            dtype, n, offsets = tensor.dtype, tensor.parameter_count, tensor.data_offsets
            shape: object = tensor.shape
            if not (isinstance(dtype, str) and isinstance(n, int) and not isinstance(n, bool)
                    and isinstance(shape, list)
                    and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                            for d in shape)
                    and n >= 0 and len(offsets) == 2
                    and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                    and 0 <= offsets[0] <= offsets[1]):
                raise FootprintError(f"{name} has a tensor whose dtype, shape or offsets are "
                                     "not a safetensors header's")
            params[dtype] = params.get(dtype, 0) + n
            stored[dtype] = stored.get(dtype, 0) + offsets[1] - offsets[0]
    return Weights(params, stored, source)


def _plain_name(directory: Path, name: object) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name \
            or name in (".", "..") or "\0" in name:
        raise FootprintError(f"{INDEX} names a shard {str(name)[:60]!r} that is not a file "
                             "name in the model directory")
    return name


def _from_index(directory: Path) -> Weights:
    index = read_json(directory / INDEX)
    weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
    if not isinstance(weight_map, Mapping):
        raise FootprintError(f"{INDEX} has no weight_map object")
    shards = sorted({_plain_name(directory, n) for n in weight_map.values()})
    if len(shards) > MAX_SHARDS:
        raise FootprintError(f"{INDEX} names {len(shards)} shards; at most {MAX_SHARDS}")
    if shards and all((directory / n).is_file() for n in shards):
        return _headers(directory, shards, f"safetensors headers ({len(shards)} shards)")
    metadata = index.get("metadata") if isinstance(index, Mapping) else None
    total = count(metadata.get("total_size")) if isinstance(metadata, Mapping) else None
    if total is None:
        raise FootprintError(f"{INDEX}: its shards are not all here and its "
                             "metadata.total_size is not a positive number")
    return Weights({}, {"?": total}, f"{INDEX} metadata.total_size (shards not here)")


def read_weights(directory: Path) -> Weights:
    """What the weights in ``directory`` hold (see the module's order)."""
    if (directory / INDEX).is_file():
        return _from_index(directory)
    files = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
    if len(files) > MAX_SHARDS:
        raise FootprintError(f"{len(files)} safetensors files; at most {MAX_SHARDS}")
    if files:
        return _headers(directory, files, f"safetensors headers ({', '.join(files[:3])}"
                        f"{', ...' if len(files) > 3 else ''})")
    others = sorted({p for pattern in _OTHER_WEIGHTS for p in directory.glob(pattern)
                     if p.is_file()})[:MAX_SHARDS]
    if not others:
        raise FootprintError(f"no weights in {directory} (no {INDEX}, *.safetensors, *.bin, "
                             "*.pt or *.pth)")
    total = sum(p.stat().st_size for p in others)
    return Weights({}, {"?": total}, f"file sizes ({len(others)} files: {others[0].name}"
                   f"{', ...' if len(others) > 1 else ''})")


def estimate_directory(directory: Path, args: Mapping[str, str]) -> Estimate:
    """The estimate for a model directory (its ``config.json`` and weights)."""
    if not directory.is_dir():
        raise FootprintError(f"{directory} is not a directory")
    config = directory / "config.json"
    if not config.is_file():
        raise FootprintError(f"{directory} has no config.json")
    decoded = read_json(config)
    try:
        weights = read_weights(directory)
    except OSError as exc:
        raise FootprintError(f"{directory} cannot be read: {exc.strerror or exc}") from None
    return estimate(decoded, weights, args)


def estimate_artifact(artifact_url: str, args: Mapping[str, str]) -> Estimate:
    """The estimate for a claim's ``artifactURL``: a local directory (``file:///path``, a
    path) is read here; any other scheme needs the artifact staged first."""
    if not is_local_artifact(artifact_url):
        raise FootprintError(f"{artifact_url} is not a local directory; the estimate reads "
                             "the artifact's files, so stage it first (download it) and "
                             "estimate its local copy (file:///PATH or a path)")
    return estimate_directory(Path(model_argument(artifact_url)), args)
