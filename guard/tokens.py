"""Where bearer tokens come from: a file (a mounted Kubernetes Secret is a file), an
environment variable, or a door's API keys file, with one rule for each.

Every server (agent API, reconciler API, front door) and every client of them reads its
token through this module, so a token is parsed, rotated and named the same way everywhere:

* A token is one word of at least 8 characters (``MIN_LENGTH``); a file holding it may end in
  a newline. An empty file, a file of several words, a file that is not UTF-8 or that cannot be
  read is a ``TokenError`` at start-up: one line naming the file and what to fix, before
  anything listens (a server started with a broken file would either be open or refuse every
  caller).
* A file is re-read when its inode, modification time or size change (``TokenFile.refresh``,
  called every couple of seconds by ``watch``), so a rotated Secret (the kubelet swaps a
  symlink) takes effect without a restart. A version that is broken keeps the last good token
  and is logged once, never an open server.
* A token is known to logs only as its ``Principal.id``: ``sha256:`` and the first eight hex
  digits of its SHA-256 digest. Tokens are kept by digest, and a caller's token is looked up by
  its digest (``Credentials.match``): what is compared is a digest, so the time a check takes
  says nothing about how much of a guess was right (a guess that shares a digest's first bytes
  shares nothing with the token).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from msgspec import Struct, field

log = logging.getLogger("guard.tokens")

MIN_LENGTH = 8
WATCH_S = 2.0  # how often a token or keys file is looked at for a change


class TokenError(ValueError):
    """A token source that cannot be used; ``str()`` is the one line to print."""


class Principal(Struct, frozen=True):
    """Who a token is: its id for logs, and what it may use (None: everything)."""

    id: str
    scopes: frozenset[str] | None = None

    def may_use(self, thing: str) -> bool:
        return self.scopes is None or thing in self.scopes


def digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def principal_id(token: str) -> str:
    return f"sha256:{digest(token)[:8]}"


class Credentials(Struct, frozen=True):
    """The tokens accepted now, by digest."""

    by_digest: Mapping[str, Principal] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.by_digest)

    def match(self, given: str | None) -> Principal | None:
        if not given:
            return None
        return self.by_digest.get(digest(given))


def one_token(text: str, source: str) -> str:
    """The token a file or variable holds, or a ``TokenError`` saying what is wrong."""
    words = text.split()
    if not words:
        raise TokenError(f"{source} is empty; write the token into it (one line)")
    if len(words) > 1:
        raise TokenError(f"{source} holds {len(words)} words; a token is one word on one "
                         "line")
    if len(words[0]) < MIN_LENGTH:
        raise TokenError(f"{source}: the token is shorter than {MIN_LENGTH} characters; use "
                         "a long random one (e.g. openssl rand -hex 32)")
    return words[0]


def credentials_of(tokens: Iterable[str]) -> Credentials:
    return Credentials({digest(t): Principal(principal_id(t)) for t in tokens})


class TokenSource(Protocol):
    """What a server checks against and a client sends."""

    def credentials(self) -> Credentials: ...

    def token(self) -> str | None: ...


class StaticToken:
    """A token given once (an environment variable)."""

    def __init__(self, token: str, source: str = "the token") -> None:
        self._token = one_token(token, source)
        self._creds = credentials_of([self._token])

    def credentials(self) -> Credentials:
        return self._creds

    def token(self) -> str | None:
        return self._token


T = TypeVar("T")


class WatchedFile(Generic[T]):
    """A file's parsed content, re-read when it changes (``refresh``); the last good
    content is kept when a new version is broken."""

    def __init__(self, path: Path, parse: Callable[[str, str], T], what: str) -> None:
        self.path = path
        self.what = what  # "--token-file", "the API keys file": for messages
        self._parse = parse
        self._stamp: tuple[int, int, int] | None = None
        self.value: T | None = None

    def _read(self) -> tuple[tuple[int, int, int], T]:
        source = f"{self.what} {self.path}"
        try:
            stat = os.stat(self.path)
            text = self.path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise TokenError(f"{source} is not UTF-8 text") from None
        except OSError as err:
            raise TokenError(f"{source} cannot be read: {err.strerror or err}") from None
        return (stat.st_ino, stat.st_mtime_ns, stat.st_size), self._parse(text, source)

    def load(self) -> None:
        """Blocking: read the file now (at start: a broken file is a ``TokenError``)."""
        self._stamp, self.value = self._read()

    def refresh(self) -> bool:
        """Blocking (a stat; a read when it changed): take a changed file. True if taken."""
        try:
            stat = os.stat(self.path)
            stamp: tuple[int, int, int] | None = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except OSError:
            stamp = None
        if stamp == self._stamp:
            return False
        self._stamp = stamp  # a broken version is reported once, not at every look
        try:
            self._stamp, value = self._read()
        except (TokenError, ValueError) as err:
            log.error("keeping the previous %s: %s", self.what, err)
            return False
        self.value = value
        log.info("%s %s changed: taken", self.what, self.path)
        return True


class TokenFile:
    """The token a file holds, re-read when the file changes."""

    def __init__(self, path: Path | str, what: str = "--token-file") -> None:
        self.file: WatchedFile[str] = WatchedFile(Path(path), one_token, what)
        self.file.load()  # a TokenError here stops the start
        self._creds = credentials_of([self._current()])

    def _current(self) -> str:
        assert self.file.value is not None  # loaded in __init__
        return self.file.value

    def credentials(self) -> Credentials:
        return self._creds

    def token(self) -> str | None:
        return self._current()

    def refresh(self) -> None:
        if self.file.refresh():
            self._creds = credentials_of([self._current()])


def token_source(path: str | None, env_token: str | None, what: str = "--token-file",
                 env_name: str = "RUNTIME_AGENT_TOKEN") -> TokenSource | None:
    """The token of ``path`` (preferred) or of an environment variable; None when neither.
    Raises ``TokenError``."""
    if path:
        return TokenFile(path, what)
    if env_token:
        return StaticToken(env_token, env_name)
    return None


async def watch(sources: Iterable[object], every_s: float = WATCH_S) -> None:
    """Look at each refreshable source every ``every_s`` until cancelled (files are read in a
    thread: a slow disk never stalls the loop)."""
    refreshable = [s for s in sources if hasattr(s, "refresh")]
    if not refreshable:
        return
    while True:
        await asyncio.sleep(every_s)
        for source in refreshable:
            await asyncio.to_thread(source.refresh)
