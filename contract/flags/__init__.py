"""The engines' own command-line flags, written down as data from their real parsers.

Each ``<kind>.tsv`` lists every option string of that engine's argument parser with its arity
(``value``, ``no-value``, ``values*``, ``values+``, ``optional-value``), its value's type and
choices (``contract.flags.values``); the file's header says which release and how it was read. The simulator refuses flags its engine does not have, an
activation (agent) or claim (reconciler) naming one is refused up front (``contract.engines``,
through ``flag_problem``), and the tests check the agent's own command lines against these
lists, so a spec that works in the simulator works on the real engine. They sit in ``contract``
because the reconciler must judge a claim's flags as the agent does, and imports no engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import cache

from contract.flags.values import table_rows, value_problem, value_types


@cache
def known_flags(kind: str) -> dict[str, str]:
    """``{flag: arity}`` for an engine kind; empty when no list is kept for it."""
    return {cols[0]: (cols[1] if len(cols) > 1 else "").strip() for cols in table_rows(kind)}


def arity_of(flag: str, known: Mapping[str, str]) -> str | None:
    """A flag's arity in ``known``, taking ``--flag_name`` for ``--flag-name`` as vLLM reads it;
    None when the parser has no such flag."""
    arity = known.get(flag)
    if arity is None and flag.startswith("--"):
        arity = known.get(flag.replace("_", "-"))
    return arity


def flag_problem(flag: str, value: str, known: Mapping[str, str], kind: str) -> str | None:
    """Why the engine's parser would refuse ``flag`` given ``value`` (``""``: no value), or None:
    an unknown flag, a value where it takes none or none where it needs one, a value that
    argparse would read as another flag, or one its type or choices refuse
    (``contract.flags.values``)."""
    arity = arity_of(flag, known)
    if arity is None:
        from difflib import get_close_matches  # only for a refusal's hint, not at start

        near = get_close_matches(flag.lower().replace("_", "-"), list(known), n=1)
        return f"{flag} is not a {kind} flag" + (f" (did you mean {near[0]}?)" if near else "")
    if arity == "no-value" and value != "":
        return f"{flag} takes no value, got {value!r}; give it \"\""
    if arity in ("value", "values+") and value == "":
        return f"{flag} needs a value"
    if _reads_as_flag(value):
        return f"{flag}'s value {value!r} would be read as another flag"
    vtype = value_types(kind).get(flag if flag in known else flag.replace("_", "-"))
    if vtype is None or (value == "" and arity in ("values*", "optional-value")):
        return None
    return value_problem(flag, value, vtype, kind)


_NEGATIVE = re.compile(r"-\d+|-\d*\.\d+")  # argparse's own test for a negative number


def _reads_as_flag(word: str) -> bool:
    """argparse reads ``word`` as an option, not as the value before it (``_parse_optional``:
    a leading '-', more than one character, no space, not a negative number)."""
    return word.startswith("-") and len(word) > 1 and " " not in word \
        and not _NEGATIVE.fullmatch(word)


def _looks_like_flag(word: str) -> bool:
    return word.startswith("-") and len(word) > 1 and not word[1].isdigit() and word[1] != "."


def _words(words: Sequence[str], known: Mapping[str, str],
           positionals: int) -> list[tuple[str, str | None, list[str]]]:
    """A command line read by each flag's arity: ``(flag, None, values)`` for a listed flag,
    ``(word, "refused", [])`` for an unknown flag or a stray positional."""
    read: list[tuple[str, str | None, list[str]]] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not _looks_like_flag(word):
            if positionals > 0:
                positionals -= 1
            else:
                read.append((word, "refused", []))
            continue
        name, eq, joined = word.partition("=")
        arity = arity_of(name, known)
        if arity is None:
            read.append((word, "refused", []))
            continue
        values = [joined] if eq else []
        if eq or arity == "no-value":
            pass
        elif arity in ("value", "optional-value"):
            if i < len(words) and not _reads_as_flag(words[i]):
                values = [words[i]]
                i += 1
        else:  # values* / values+
            while i < len(words) and not _reads_as_flag(words[i]):
                values.append(words[i])
                i += 1
        missing = not values and arity in ("value", "values+")
        read.append((name, "missing" if missing else None, list(values)))
    return read


def unrecognized(words: Sequence[str], known: Mapping[str, str], positionals: int = 1) -> list[str]:
    """The words of a command line (after ``serve``) that the engine's parser would not take:
    unknown flags and stray positionals. Values are skipped by each flag's arity (``value``,
    ``no-value``, ``values*``, ``values+``, ``optional-value``); ``--flag_name`` is
    ``--flag-name``, as vLLM reads it. ``positionals``: how many plain words the parser takes
    (``vllm serve``'s MODEL)."""
    return [word for word, refused, _ in _words(words, known, positionals) if refused == "refused"]


def invalid_values(words: Sequence[str], known: Mapping[str, str], kind: str,
                   positionals: int = 1) -> list[str]:
    """Why ``kind``'s parser would refuse the values on a command line: a flag without the
    value it needs, or one its type or choices refuse (``contract.flags.values``); the values
    of flags not in ``kind``'s table (the simulator's ``--sim-*``) are not judged here."""
    types = value_types(kind)
    found: list[str] = []
    for flag, refused, values in _words(words, known, positionals):
        if refused == "missing":
            found.append(f"{flag} needs a value")  # argparse: "expected one argument"
            continue
        vtype = types.get(flag if flag in types else flag.replace("_", "-"))
        if refused or vtype is None:
            continue
        found += [problem for value in values
                  if (problem := value_problem(flag, value, vtype, kind)) is not None]
    return found
