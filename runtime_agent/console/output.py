"""How the command line prints: ``-o table|wide|json|yaml``, columns, sizes, a closed pipe.

Tables are for people (sizes in GiB, one line per engine); ``-o json`` and ``-o yaml`` print
the API's own answer unchanged, for scripts. A reader that closes the pipe early
(``runtime-agent events | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import yaml  # type: ignore[import-untyped]

from contract.quantity import gib

FORMATS = ("table", "wide", "json", "yaml")


def add_output_flag(parser: argparse.ArgumentParser, formats: Sequence[str] = FORMATS) -> None:
    parser.add_argument("-o", "--output", choices=formats, default="table",
                        help="table (default); " + ("wide: more columns; " if "wide" in formats
                                                    else "") + "json or yaml: the API's answer "
                        "unchanged, for scripts")


def render(data: Any, fmt: str, table: Callable[[Any, bool], str]) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2)
    if fmt == "yaml":
        return str(yaml.safe_dump(data, sort_keys=False, allow_unicode=True)).rstrip("\n")
    return table(data, fmt == "wide")


def columns(rows: Sequence[Sequence[str]], gap: str = "  ") -> str:
    """Left-aligned columns, as kubectl prints them."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(gap.join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def size(value: Any) -> str:
    """Bytes for people: ``1.5GiB``; ``-`` when not known."""
    return "-" if value is None else gib(value, sep="")


def number(value: Any) -> str:
    return "-" if value is None else f"{value:g}"


def quiet_on_closed_pipe(run: Callable[[], int]) -> int:
    """Run a command; a reader that went away (``| head``) ends it quietly with 0."""
    try:
        code = run()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Python would complain again when it flushes stdout at exit: point it at /dev/null.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 0
