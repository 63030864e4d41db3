"""Whole numbers read from outside text: headers, flag values, environment, command lines.

``str.isdigit()`` is true for ``"²"`` and ``"١"``; ``int()`` refuses the first, takes the
second, and refuses any string of more than 4,300 digits. A reader that checks ``isdigit()``
and then calls ``int()`` therefore raises on hostile text it meant to refuse. Every such reader
goes through ``whole_number`` instead: ASCII digits only, at most ``MAX_DIGITS`` of them, never
an exception.
"""

from __future__ import annotations

# 10**18 - 1: more than any count, size or port this code reads, and under 2**63.
MAX_DIGITS = 18


def whole_number(text: str, *, strip: bool = False) -> int | None:
    """The value of ``text`` when it is 1 to ``MAX_DIGITS`` ASCII digits, else None.

    ``strip`` first removes surrounding whitespace (what ``int()`` would also ignore)."""
    if strip:
        text = text.strip()
    if not 0 < len(text) <= MAX_DIGITS or not text.isascii() or not text.isdigit():
        return None
    return int(text)
