"""Checksums as bytes arrive: a file-like writer that hashes what it writes, counts progress and
stops when the download is cancelled.

Hashing on the way in costs no second read of a multi-gigabyte file. One checksum per file is
enough; the strongest the source gave is chosen (``STRENGTH``). A resumed file hashes its
existing prefix once when the writer opens. The writer also takes the rewind that
``huggingface_hub``'s ``http_get`` does when a server ignores a Range request (seek back, then
truncate), so a restarted transfer is hashed from its true start.
"""

from __future__ import annotations

import base64
import hashlib
import queue
import threading
import zlib
from typing import Any, BinaryIO, Protocol

# Strongest first; algorithms the cache cannot compute (crc32c, crc64nvme) are left out.
STRENGTH = ("sha256", "git-sha1", "sha1", "crc32", "md5")
READ_CHUNK = 8 << 20


class Cancelled(Exception):
    """The download was cancelled (a DELETE, an agent shutdown)."""


class _Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


class _Pipelined:
    """A hasher fed through a queue by a thread of its own: hashlib and zlib release the GIL on
    large buffers, so the checksum runs beside the network and disk instead of after them."""

    def __init__(self, inner: _Hasher) -> None:
        self._inner = inner
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=16)
        self._thread = threading.Thread(target=self._run, name="hash", daemon=True)
        self._thread.start()
        self._digest: str | None = None

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            self._inner.update(data)

    def update(self, data: bytes, /) -> None:
        self._queue.put(bytes(data))

    def hexdigest(self) -> str:
        if self._digest is None:
            self._queue.put(None)
            self._thread.join()
            self._digest = self._inner.hexdigest()
        return self._digest


def choose(checksums: dict[str, str]) -> str | None:
    """The algorithm to check for a file, or None (size only)."""
    return next((a for a in STRENGTH if a in checksums), None)


def new_hasher(algorithm: str, size: int) -> _Hasher:
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "git-sha1":  # a git blob id: sha1 over a header and the content
        h = hashlib.sha1()
        h.update(b"blob %d\0" % size)
        return h
    return hashlib.new(algorithm)


def b64_to_hex(value: str) -> str:
    """S3 gives checksums base64-encoded; the cache keeps hex."""
    return base64.b64decode(value).hex()


class Progress:
    """Bytes a download has on disk; written by its transfer thread, read by anyone."""

    def __init__(self, total: int = 0) -> None:
        self.total = total
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n


class HashingWriter:
    """Writes to ``fh`` (opened for appending at ``offset``), hashing and counting each chunk."""

    def __init__(self, fh: BinaryIO, algorithm: str | None, size: int, offset: int,
                 progress: Progress, cancelled: threading.Event) -> None:
        self._fh = fh
        self._algorithm = algorithm
        self._size = size
        self._progress = progress
        self._cancelled = cancelled
        self._hasher: _Pipelined | None = None
        self.pos = 0
        self._rehash(offset)
        progress.add(offset)

    def _rehash(self, upto: int) -> None:
        """Hash the file's first ``upto`` bytes again (a resumed prefix, or after a rewind)."""
        self.close()
        self._hasher = _Pipelined(new_hasher(self._algorithm, self._size)) \
            if self._algorithm else None
        self._fh.seek(0)
        left = upto
        while left > 0:
            chunk = self._fh.read(min(READ_CHUNK, left))
            if not chunk:
                raise OSError(f"partial file is shorter than {upto} bytes")
            if self._hasher is not None:
                self._hasher.update(chunk)
            left -= len(chunk)
        self._fh.seek(upto)
        self.pos = upto

    def write(self, data: bytes) -> int:
        if self._cancelled.is_set():
            raise Cancelled("the download was cancelled")
        written = self._fh.write(data)
        if self._hasher is not None:
            self._hasher.update(data)
        self.pos += len(data)
        self._progress.add(len(data))
        return written

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != 0 or pos > self.pos:
            raise OSError("the download writer only rewinds")
        before = self.pos
        self._rehash(pos)
        self._progress.add(pos - before)
        return pos

    def truncate(self, size: int | None = None) -> int:
        return self._fh.truncate(self.pos if size is None else size)

    def flush(self) -> None:
        self._fh.flush()

    def hexdigest(self) -> str | None:
        return self._hasher.hexdigest() if self._hasher is not None else None

    def close(self) -> None:
        """End the hashing thread (also when the download failed)."""
        if self._hasher is not None:
            self._hasher.hexdigest()

    def __getattr__(self, name: str) -> Any:  # fileno, closed, ... from the real file
        return getattr(self._fh, name)
