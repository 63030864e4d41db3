"""Sizes as byte counts, one parser for manifests, flags and the API: "6Gi", "512MiB", "1G".

The grammar is Kubernetes': a signed decimal number, then either a binary suffix (Ki Mi Gi Ti Pi
Ei), a decimal suffix (n u m k M G T P E) or a decimal exponent (e3, E-2). Operators also write
byte units, so ``KiB MiB GiB TiB PiB`` (binary), ``kB KB MB GB TB PB`` (decimal) and ``B`` are
taken too, in any letter case (``80GiB`` is ``80Gi``). A fraction of a byte rounds up, as
Kubernetes' ``Quantity.Value()`` does. Numbers from YAML (int, float) are plain bytes; a bool
is not a quantity. Manifests take Kubernetes' grammar alone (``parse_quantity``, as the CRD's
schema does); flags and the CLI take byte units too (``parse_size``).
"""

from __future__ import annotations

import argparse
import math
import re
from fractions import Fraction

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30  # the one GiB constant of the product
TiB = 1 << 40

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
            "": Fraction(1), "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9),
            "T": Fraction(10**12), "P": Fraction(10**15), "E": Fraction(10**18)}
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|[eE](?P<exponent>[+-]?\d+)|(?P<decimal>[numkMGTPE]?))$"
)
# Far beyond any GPU; keeps a hostile exponent from building an enormous integer.
_MAX_EXPONENT = 30


_BYTE_UNIT = re.compile(r"^(?P<head>.*?\d\.?)\s*(?P<unit>[kKmMgGtTpP]?[iI]?[bB])$")


class QuantityError(ValueError):
    """The value is not a Kubernetes quantity."""


def parse_quantity(value: object) -> int:
    """Bytes in ``value``, rounded up to a whole byte. Raises ``QuantityError`` when invalid."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a quantity; write bytes or a value like 6Gi")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise QuantityError(f"{value!r} is not a finite quantity")
        return math.ceil(Fraction(value))
    if not isinstance(value, str):
        raise QuantityError(f"{value!r} is not a quantity; write bytes or a value like 6Gi")
    return _parse(value.strip(), value)


def _parse(text: str, shown: object) -> int:
    match = _QUANTITY.match(text)
    if match is None:
        raise QuantityError(
            f"{shown!r} is not a quantity; write bytes or a number with a suffix such as "
            "Ki, Mi, Gi, Ti, k, M, G or T (for example 6Gi, 512Mi, 1G)")
    number = Fraction(match["number"])
    if match["binary"]:
        scaled = number * _BINARY[match["binary"]]
    elif match["exponent"] is not None:
        exponent = int(match["exponent"])
        if abs(exponent) > _MAX_EXPONENT:
            raise QuantityError(f"{shown!r}: exponent {exponent} is out of range")
        scaled = number * Fraction(10) ** exponent
    else:
        scaled = number * _DECIMAL[match["decimal"] or ""]
    return math.ceil(scaled)


def _kubernetes_form(text: str) -> str:
    """``80GiB`` -> ``80Gi``, ``141GB`` -> ``141G``, ``512 b`` -> ``512``; others unchanged."""
    match = _BYTE_UNIT.match(text)
    if match is None:
        return text
    unit = match["unit"].upper()
    prefix = unit[0] if unit != "B" else ""
    binary = unit.endswith("IB") and prefix
    if prefix == "K" and not binary:
        prefix = "k"
    return match["head"] + prefix + ("i" if binary else "")


def parse_size(text: str) -> int:
    """A positive size from a flag or the CLI, where byte units (``80GiB``, ``141GB``) are taken
    as well as Kubernetes' suffixes; ``QuantityError`` says what is wrong."""
    try:
        value = _parse(_kubernetes_form(text.strip()), text)
    except QuantityError:
        raise QuantityError(f"{text!r} is not a size; write bytes or a number with a unit such as "
                            "512MiB, 80GiB, 141GB or 6Gi") from None
    if value <= 0:
        raise QuantityError(f"{text!r} must be a positive size")
    return value


def size_type(text: str) -> int:
    """``parse_size`` as an argparse type: the agent's ``serve`` and the client commands."""
    try:
        return parse_size(text)
    except QuantityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def gib(nbytes: float, sep: str = " ") -> str:
    """A size as people read it, in binary units with one decimal: ``7.0 GiB``, ``1.0 TiB``,
    ``512.0 MiB``, ``1.5 KiB``, plain bytes below a KiB (``12 B``), never ``0.0 GiB``; ``sep``
    goes between number and unit (tables leave it out: ``1.5GiB``). The one byte formatter of
    the agent's and the reconciler's messages, the weight cache's and the console's."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f}{sep}{unit}"
    return f"{int(nbytes)}{sep}B"


def quantity(nbytes: int) -> str:
    """Bytes as a Kubernetes quantity, exact when a binary suffix divides them (``6Gi``,
    ``512Mi``), else plain bytes: how a manifest would have written it."""
    for suffix, scale in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if nbytes and nbytes % scale == 0:
            return f"{nbytes // scale}{suffix}"
    return str(nbytes)
