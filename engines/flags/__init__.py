"""The engines' own command-line flags, written down as data from their real parsers.

Each ``<kind>.tsv`` lists every option string of that engine's argument parser with its arity
(``value``, ``no-value``, ``values*``, ``values+``, ``optional-value``); the file's header says
which release and how it was read. The simulator refuses flags its engine does not have, and the
tests check the agent's own command lines against these lists, so a spec that works in the
simulator works on the real engine.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

_DIR = Path(__file__).resolve().parent


@cache
def known_flags(kind: str) -> dict[str, str]:
    """``{flag: arity}`` for an engine kind; empty when no list is kept for it."""
    path = _DIR / f"{kind}.tsv"
    if not path.exists():
        return {}
    flags: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        flag, _, arity = line.partition("\t")
        flags[flag] = arity.strip()
    return flags
