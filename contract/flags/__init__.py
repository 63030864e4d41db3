"""The engines' own command-line flags, written down as data from their real parsers.

Each ``<kind>.tsv`` lists every option string of that engine's argument parser with its arity
(``value``, ``no-value``, ``values*``, ``values+``, ``optional-value``); the file's header says
which release and how it was read. The simulator refuses flags its engine does not have, an
activation (agent) or claim (reconciler) naming one is refused up front (``contract.engines``,
through ``flag_problem``), and the tests check the agent's own command lines against these
lists, so a spec that works in the simulator works on the real engine. They sit in ``contract``
because the reconciler must judge a claim's flags as the agent does, and imports no engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from difflib import get_close_matches
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


def arity_of(flag: str, known: Mapping[str, str]) -> str | None:
    """A flag's arity in ``known``, taking ``--flag_name`` for ``--flag-name`` as vLLM reads it;
    None when the parser has no such flag."""
    arity = known.get(flag)
    if arity is None and flag.startswith("--"):
        arity = known.get(flag.replace("_", "-"))
    return arity


def flag_problem(flag: str, value: str, known: Mapping[str, str], kind: str) -> str | None:
    """Why the engine's parser would refuse ``flag`` given ``value`` (``""``: no value), or None.

    Arity only: the lists carry no value types, so a value of the wrong kind is the engine's to
    refuse."""
    arity = arity_of(flag, known)
    if arity is None:
        near = get_close_matches(flag.lower().replace("_", "-"), list(known), n=1)
        return f"{flag} is not a {kind} flag" + (f" (did you mean {near[0]}?)" if near else "")
    if arity == "no-value" and value != "":
        return f"{flag} takes no value, got {value!r}; give it \"\""
    if arity in ("value", "values+") and value == "":
        return f"{flag} needs a value"
    return None


def _looks_like_flag(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not word[1].isdigit() and word[1] != "."


def unrecognized(words: Sequence[str], known: Mapping[str, str], positionals: int = 1) -> list[str]:
    """The words of a command line (after ``serve``) that the engine's parser would not take:
    unknown flags and stray positionals. Values are skipped by each flag's arity (``value``,
    ``no-value``, ``values*``, ``values+``, ``optional-value``); ``--flag_name`` is
    ``--flag-name``, as vLLM reads it. ``positionals``: how many plain words the parser takes
    (``vllm serve``'s MODEL)."""
    refused: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not _looks_like_flag(word):
            if positionals > 0:
                positionals -= 1
            else:
                refused.append(word)
            continue
        name, eq, _ = word.partition("=")
        arity = arity_of(name, known)
        if arity is None:
            refused.append(word)
            continue
        if eq or arity == "no-value":
            continue
        if arity == "value":
            i += 1
        elif arity == "optional-value":
            i += int(i < len(words) and not _looks_like_flag(words[i]))
        else:  # values* / values+
            while i < len(words) and not _looks_like_flag(words[i]):
                i += 1
    return refused
