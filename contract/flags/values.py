"""What each engine flag's value may be, from the type and choices of the engine's own parser.

A flag the engine has, given a value its parser cannot convert (``--max-model-len abc``), was
accepted at activation, and the engine then exited with code 2 at every start until its
restart budget was spent. The third and fourth columns of ``<kind>.tsv`` say what the parser's
``type=`` and ``choices=`` take; each word below converts a value as that parser would, so a
value is refused here exactly when argparse would refuse it there:

- ``int``, ``float``: Python's ``int()`` and ``float()`` (what argparse calls);
- ``str``: anything; ``lower``: anything, lowercased before the choices are compared;
- ``json``: ``json.loads``; ``json-or-str`` (vLLM): JSON when it looks like ``{...}``, else any;
- ``size``: a whole number or one with a suffix: vLLM's ``1k`` (10^3) / ``1K`` (2^10), k m g t,
  decimals with the lower-case ones only; SGLang's ``1k`` ``1M`` ``1G`` ``1T`` (SI, decimals
  allowed) and ``1Ki`` ``1Mi`` ``1Gi`` ``1Ti`` (IEC); ``size-or-auto``: also ``auto`` and ``-1``;
- ``any``: a converter not modelled (a dataclass from JSON, a device list): not checked;
- ``-``: the flag takes no value (its arity says so).

``optional`` before a word: ``""`` and ``"None"`` are taken as well (vLLM's ``optional_type``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from decimal import Decimal
from functools import cache
from pathlib import Path

from msgspec import Struct

_DIR = Path(__file__).resolve().parent


class ValueType(Struct, frozen=True):
    """One flag's value type: a word of the module docstring, optional or not, and choices."""

    word: str
    optional: bool = False
    choices: tuple[str, ...] = ()


@cache
def table_rows(kind: str) -> tuple[tuple[str, ...], ...]:
    """The rows of ``<kind>.tsv`` (flag, arity, value type, choices), comments left out; empty
    when no table is kept for that kind."""
    path = _DIR / f"{kind}.tsv"
    if not path.exists():
        return ()
    return tuple(tuple(line.split("\t")) for line in path.read_text().splitlines()
                 if line and not line.startswith("#"))


@cache
def value_types(kind: str) -> dict[str, ValueType]:
    """``{flag: ValueType}`` for an engine kind, from the third and fourth columns of its table."""
    types: dict[str, ValueType] = {}
    for cols in table_rows(kind):
        word = cols[2].strip() if len(cols) > 2 else "any"
        choices = tuple(cols[3].split("|")) if len(cols) > 3 and cols[3] else ()
        types[cols[0]] = ValueType(word.removeprefix("optional "), word.startswith("optional "),
                                   choices)
    return types


_VLLM_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_SGLANG_SIZE = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")
_SI = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
        "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _size(value: str, kind: str) -> int:
    """A size as the engine's ``human_readable_int`` reads it; ValueError when it cannot."""
    text = value.strip()
    if kind == "sglang":
        match = _SGLANG_SIZE.fullmatch(text)
        binary = match is not None and match.group(2).endswith("i")
    else:
        match = _VLLM_SIZE.fullmatch(text)
        binary = match is not None and match.group(2).isupper()
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if binary:
        return int(number) * _IEC[suffix]  # decimals are refused with a binary suffix
    return int(Decimal(number) * _SI[suffix])


def _size_or_auto(value: str, kind: str) -> int:
    text = value.strip()
    return -1 if text == "-1" or text.lower() == "auto" else _size(text, kind)


def _json_or_str(value: str, _kind: str) -> object:
    return json.loads(value) if re.match(r"(?s)^\s*{.*}\s*$", value) else value


_CONVERT: dict[str, Callable[[str, str], object]] = {
    "int": lambda value, _kind: int(value),
    "float": lambda value, _kind: float(value),
    "str": lambda value, _kind: value,
    "lower": lambda value, _kind: value.lower(),
    "json": lambda value, _kind: json.loads(value),
    "json-or-str": _json_or_str,
    "size": _size,
    "size-or-auto": _size_or_auto,
}
_WHAT = {
    "int": "a whole number",
    "float": "a number",
    "json": "JSON",
    "json-or-str": "a JSON object when it starts with '{'",
    "size": "a whole number, or one with a suffix such as 1k or 2M",
    "size-or-auto": "a whole number, one with a suffix such as 1k or 2M, or auto",
}


def convert(value: str, vtype: ValueType, kind: str) -> object:
    """``value`` converted as the engine's parser would; ValueError when it would refuse it."""
    if vtype.optional and value in ("", "None"):
        return None
    convert_one = _CONVERT.get(vtype.word)
    if convert_one is None:
        return value
    try:
        return convert_one(value, kind)
    except (ValueError, OverflowError, RecursionError) as exc:  # json's errors are ValueErrors
        raise ValueError(f"takes {_WHAT.get(vtype.word, vtype.word)}") from exc


def value_problem(flag: str, value: str, vtype: ValueType, kind: str) -> str | None:
    """Why ``kind``'s parser would refuse ``value`` for ``flag`` (typed ``vtype``), or None."""
    if vtype.word in ("-", "any"):
        return None
    try:
        converted = convert(value, vtype, kind)
    except ValueError as exc:
        return f"{flag} {exc}, got {value!r}"
    if vtype.choices and converted is not None:
        allowed = []
        for choice in vtype.choices:
            try:
                allowed.append(convert(choice, vtype, kind))
            except ValueError:
                continue
        if converted not in allowed:
            return f"{flag} takes one of {', '.join(vtype.choices)}, got {value!r}"
    return None
