"""``runtime-agent claims estimate ARTIFACT [--arg FLAG[=VALUE] ...] [-o table|json]``: the
figures a claim without ``perGPU`` is placed on, printed before anyone writes the claim.

The first wall a new user meets is "declare maximumFootprint and kvFloor" with nothing to find
them; this command reads the artifact (a local model directory) the way the reconciler does
(``contract.footprint``) and prints each figure with what it came from, and the ``perGPU``
block to paste, rounded up to a MiB. Exit 0: figures; 1: cannot estimate (the line says why).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from contract.footprint.estimate import Estimate, FootprintError
from contract.footprint.reading import estimate_artifact, estimate_directory
from contract.quantity import MiB

EXIT_CANNOT = 1


def add_estimate(csub: Any) -> None:
    """Add ``estimate`` to the ``claims`` subcommands."""
    e = csub.add_parser("estimate", help="a model's GPU figures (perGPU) from its files",
                        description="Read a local model directory (config.json and its "
                        "safetensors headers) and print the weights, the KV floor (2 x layers "
                        "x KV heads x head size x bytes per value x maximum length) and the "
                        "footprint one engine would need, each with where it came from. "
                        "Nothing is started. Exit 0: figures; 1: cannot estimate.")
    e.add_argument("artifact", metavar="ARTIFACT",
                   help="a model directory: a path or file:///PATH (other schemes: stage the "
                   "artifact first and give its local copy)")
    e.add_argument("--arg", action="append", default=[], metavar="FLAG[=VALUE]",
                   help="an engine flag the claim will pass, repeatable: --arg "
                   "--max-model-len=2048, --arg --kv-cache-dtype=fp8, --arg --dtype=float32")
    e.add_argument("-o", "--output", choices=("table", "json"), default="table")
    e.set_defaults(func=run_estimate)


def _mib(nbytes: int) -> str:
    return f"{math.ceil(nbytes / MiB)}Mi"


def table(got: Estimate) -> str:
    """The figures for people: one row each, then the inputs, then the block to paste."""
    rows = [("WEIGHTS", got.weights), ("KV FLOOR", got.kv_floor), ("FOOTPRINT", got.footprint)]
    lines = [f"{'FIGURE':<10} {'BYTES':>15} {'MIB':>9}  FROM"]
    lines += [f"{name:<10} {fig.bytes:>15,} {fig.bytes / MiB:>9.1f}  {fig.source}"
              for name, fig in rows]
    lines.append(f"{'STORED':<10} {got.stored_bytes:>15,} {got.stored_bytes / MiB:>9.1f}  "
                 "what the weight files hold")
    lines.append("")
    lines += [f"  {name}: {value}" for name, value in got.inputs.items()]
    lines += ["", "perGPU (estimated; the figure measured once the engine runs replaces it):",
              f"  maximumFootprint: {_mib(got.footprint.bytes)}",
              f"  kvFloor: {_mib(got.kv_floor.bytes)}"]
    return "\n".join(lines)


def run_estimate(args: argparse.Namespace) -> int:
    flags = dict(item.partition("=")[::2] for item in args.arg)
    try:
        path = Path(args.artifact)
        got = estimate_directory(path, flags) if path.is_dir() else \
            estimate_artifact(args.artifact, flags)
    except FootprintError as exc:
        print(f"runtime-agent claims estimate: {exc}", file=sys.stderr)
        return EXIT_CANNOT
    if args.output == "json":
        print(json.dumps(got.as_json(), indent=2))
    else:
        print(table(got))
    return 0
