"""API keys for the door, from a file (a mounted Kubernetes Secret is a file too).

One key per line, optionally followed by the models it may use; ``#`` starts a comment::

    sk-team-a                      # any model
    sk-team-b  qwen3-0.6b  minilm  # only these two

Clients send ``Authorization: Bearer KEY`` (OpenAI's header). Keys are held as SHA-256 digests and
compared by digest, so a lookup does not take longer for a near miss; the access log names a key
by ``sha256:`` and the first eight hex digits of its digest, never by the key. ``KeyFile``
re-reads the file when its modification time or size changes (``check``, called every couple of
seconds), so keys are rotated without a restart; a file that cannot be read keeps the last good
keys and is logged.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("reconciler.door.keys")


class KeysError(ValueError):
    """The keys file is unusable."""


@dataclass(frozen=True)
class Key:
    id: str  # "sha256:" + first 8 hex digits: what logs show
    models: frozenset[str] | None  # None: any model

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_keys(text: str, source: str = "keys file") -> dict[str, Key]:
    """Keys by digest; a line with a space inside a key cannot happen (the first word is it)."""
    keys: dict[str, Key] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, *models = line.split()
        if len(key) < 8:
            raise KeysError(f"{source} line {number}: a key must have at least 8 characters")
        d = digest(key)
        if d in keys:
            raise KeysError(f"{source} line {number}: the key is listed twice")
        keys[d] = Key(f"sha256:{d[:8]}", frozenset(models) if models else None)
    return keys


def bearer(header: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header (None when absent or malformed)."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    return value if scheme.lower() == "bearer" and value else None


class KeyFile:
    """The keys of ``path``, re-read when it changes. Without a path the door is open."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._keys: Mapping[str, Key] = {}
        self._stamp: tuple[float, int] | None = None

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def lookup(self, key: str | None) -> Key | None:
        if key is None:
            return None
        return self._keys.get(digest(key))

    def load(self) -> None:
        """Blocking: read the file now (at start; a broken file then is an error)."""
        if self.path is None:
            return
        try:
            stat = os.stat(self.path)
            self._keys = parse_keys(self.path.read_text("utf-8"), str(self.path))
        except OSError as err:
            raise KeysError(f"cannot read the API keys file {self.path}: {err}") from err
        self._stamp = (stat.st_mtime, stat.st_size)
        log.info("door: %d API keys from %s", len(self._keys), self.path)

    def check(self) -> None:
        """Blocking (a stat, and a read when it changed): take a changed file's keys."""
        if self.path is None:
            return
        try:
            stat = os.stat(self.path)
        except OSError:
            stamp = None
        else:
            stamp = (stat.st_mtime, stat.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp  # a broken version is reported once, not at every check
        try:
            keys = parse_keys(self.path.read_text("utf-8"), str(self.path))
        except (OSError, KeysError) as err:
            log.error("door: keeping the previous API keys: %s", err)
            return
        self._keys = keys
        log.info("door: %d API keys from %s (changed)", len(keys), self.path)
