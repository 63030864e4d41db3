"""Reprs that leave secrets out: a value holding a token or credentials may reach a log line."""

from __future__ import annotations

from collections.abc import Collection

from msgspec import Struct



def repr_without(value: Struct, hidden: Collection[str]) -> str:
    """``value``'s repr with the fields named in ``hidden`` left out (as a dataclass field with
    ``repr=False`` is)."""
    shown = (f"{name}={getattr(value, name)!r}" for name in value.__struct_fields__
             if name not in hidden)
    return f"{type(value).__name__}({', '.join(shown)})"
