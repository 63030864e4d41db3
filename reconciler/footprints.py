"""Footprints measured on running engines: the first source of a claim's figures, the estimate
only the second (Kubemoot's "observed first, declared second"; a declared perGPU still wins).

A claim placed on an estimate (``reconciler.model.estimated``) carries it until its engine runs.
Then its agent's snapshot says what the engine holds: its peak HBM less the KV cache in use (the
seed's measuring recipe), per GPU of the engine. That figure is recorded per artifact and engine
arguments, since one engine's measurement fits every claim that runs the same files the same
way, and it replaces the estimate's footprint from then on (the KV floor stays the formula's:
it is what the engine's arguments ask for, not what it happens to use). The largest figure seen
is kept, rounded up to a MiB: a footprint is a peak.

The book lives in a JSON file beside the claim statuses (``<state-dir>/observed-footprints.json``,
written whole and atomically; an unreadable one is logged and started afresh), or in memory only
when the reconciler keeps no state directory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from guard.files import write_atomically

log = logging.getLogger("reconciler.footprints")

MiB = 1 << 20
FILE_NAME = "observed-footprints.json"
MAX_FILE_BYTES = 4 * MiB
MAX_ENTRIES = 4096  # artifacts x argument sets a pool runs; the oldest go first past it


@dataclass(frozen=True)
class Measured:
    """One engine's measurement, per GPU, in bytes."""

    footprint: int
    agent: str
    at: float  # wall-clock seconds
    peak: int
    kv_used: int

    def source(self) -> str:
        return (f"measured on {self.agent}: peak HBM {self.peak} bytes less {self.kv_used} of "
                "KV cache in use, per GPU")


def book_key(artifact: str, args: Mapping[str, str]) -> str:
    return json.dumps([artifact, sorted(args.items())], separators=(",", ":"))


def measured_footprint(peak: int | None, kv_used: int | None, gpus: int) -> int | None:
    """Bytes per GPU the engine holds besides its KV cache (None: not measured)."""
    if peak is None or kv_used is None or peak <= 0 or gpus < 1 or kv_used < 0 \
            or kv_used >= peak:
        return None
    per_gpu = (peak - kv_used + gpus - 1) // gpus
    return -(-per_gpu // MiB) * MiB


class FootprintBook:
    """``get`` and ``observe``; ``version`` moves with every change (for caches over it)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.version = 0
        self._entries: dict[str, Measured] = {}
        if path is not None:
            self._load(path)

    def get(self, artifact: str, args: Mapping[str, str]) -> Measured | None:
        return self._entries.get(book_key(artifact, args))

    def lookup(self, artifact: str, args: Mapping[str, str]) -> tuple[int, str] | None:
        """(footprint bytes, where it came from), for ``reconciler.model.estimated``."""
        found = self.get(artifact, args)
        return (found.footprint, found.source()) if found is not None else None

    def observe(self, artifact: str, args: Mapping[str, str], measured: Measured) -> bool:
        """Record ``measured`` unless a figure at least as large is known; True when it changed
        the book (and the file, which is written now: blocking, and rare)."""
        key = book_key(artifact, args)
        known = self._entries.get(key)
        if known is not None and known.footprint >= measured.footprint:
            return False
        self._entries.pop(key, None)
        self._entries[key] = measured
        while len(self._entries) > MAX_ENTRIES:
            del self._entries[next(iter(self._entries))]
        self.version += 1
        self._save()
        return True

    def _save(self) -> None:
        if self.path is None:
            return
        rows = [{"key": json.loads(k), **asdict(m)} for k, m in self._entries.items()]
        data = json.dumps({"version": 1, "footprints": rows}, indent=1).encode()
        try:
            write_atomically(self.path, data)
        except OSError as exc:
            log.warning("cannot write %s (%s); measured footprints are kept in memory",
                        self.path, exc)

    def _load(self, path: Path) -> None:
        try:
            if not path.exists():
                return
            if path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            doc = json.loads(path.read_bytes())
            for row in doc["footprints"][:MAX_ENTRIES]:
                artifact, args = row["key"]
                measured = Measured(int(row["footprint"]), str(row["agent"]), float(row["at"]),
                                    int(row["peak"]), int(row["kv_used"]))
                if measured.footprint > 0:
                    self._entries[book_key(str(artifact), dict(args))] = measured
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            log.warning("measured footprints in %s cannot be read (%s); starting afresh", path,
                        exc)
            self._entries.clear()
