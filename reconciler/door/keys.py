"""API keys for the door, from a file (a mounted Kubernetes Secret is a file too).

One key per line, optionally followed by the models it may use; ``#`` starts a comment::

    sk-team-a                      # any model
    sk-team-b  qwen3-0.6b  minilm  # only these two

Clients send ``Authorization: Bearer KEY`` (OpenAI's header). The file is read, watched and
checked by the same code as every server's token (``guard.tokens``, ``guard.access``): keys are
held as SHA-256 digests and looked up by digest, a key is named in logs by ``sha256:`` and the
first eight hex digits of its digest (``Key.id``), never by the key, and a changed file (its
inode, modification time or size) is re-read without a restart, a broken version keeping the
last good keys. A file that cannot be used at start-up is a ``KeysError``, one line naming the
line to fix; the command line reads the file before anything listens
(``reconciler.options.door_settings``).
"""

from __future__ import annotations

from pathlib import Path

from guard.tokens import MIN_LENGTH, Credentials, Principal, TokenError, WatchedFile, digest, \
    principal_id

Key = Principal  # a key's id and the models it may use (scopes; None: any model)
KeysError = TokenError  # the keys file is unusable: str() is the one line to print
WHAT = "the API keys file"


def parse_keys(text: str, source: str = "keys file") -> Credentials:
    """Keys by digest; a line with a space inside a key cannot happen (the first word is it)."""
    keys: dict[str, Key] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, *models = line.split()
        if len(key) < MIN_LENGTH:
            raise KeysError(f"{source} line {number}: a key must have at least {MIN_LENGTH} "
                            "characters")
        d = digest(key)
        if d in keys:
            raise KeysError(f"{source} line {number}: the key is listed twice")
        keys[d] = Key(principal_id(key), frozenset(models) if models else None)
    return Credentials(keys)


def check_keys_file(path: Path) -> None:
    """Blocking: read ``path`` as the door would, for the command line before it listens;
    a ``KeysError`` says what is wrong."""
    KeyFile(path).load()


class KeyFile:
    """The keys of ``path``, re-read when it changes (``check``). Without a path the door is
    open."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file = WatchedFile(path, parse_keys, WHAT) if path is not None else None

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def credentials(self) -> Credentials:
        if self._file is None or self._file.value is None:
            return Credentials()
        return self._file.value

    def lookup(self, key: str | None) -> Key | None:
        return self.credentials().match(key)

    def load(self) -> None:
        """Blocking: read the file now (at start; a broken file then is a ``KeysError``)."""
        if self._file is not None:
            self._file.load()

    def check(self) -> None:
        """Blocking (a stat, and a read when it changed): take a changed file's keys."""
        if self._file is not None:
            self._file.refresh()
