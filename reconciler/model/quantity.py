"""Kubernetes resource quantities as byte counts: "6Gi", "512Mi", "1G", "1.5e9", 1073741824.

The grammar is Kubernetes': a signed decimal number, then either a binary suffix (Ki Mi Gi Ti Pi
Ei), a decimal suffix (n u m k M G T P E) or a decimal exponent (e3, E-2). A fraction of a byte
rounds up, as Kubernetes' ``Quantity.Value()`` does. Numbers from YAML (int, float) are taken as
plain bytes; a bool is not a quantity.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

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
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise QuantityError(
            f"{value!r} is not a quantity; write bytes or a number with a suffix such as "
            "Ki, Mi, Gi, Ti, k, M, G or T (for example 6Gi, 512Mi, 1G)")
    number = Fraction(match["number"])
    if match["binary"]:
        scaled = number * _BINARY[match["binary"]]
    elif match["exponent"] is not None:
        exponent = int(match["exponent"])
        if abs(exponent) > _MAX_EXPONENT:
            raise QuantityError(f"{value!r}: exponent {exponent} is out of range")
        scaled = number * Fraction(10) ** exponent
    else:
        scaled = number * _DECIMAL[match["decimal"] or ""]
    return math.ceil(scaled)


def gib(nbytes: int) -> str:
    """Bytes as GiB with one decimal, as messages show them: ``7.0 GiB``."""
    return f"{nbytes / GiB:.1f} GiB"
