"""The source interface and its error: what a download needs from wherever the bytes live."""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

from runtime_agent.artifacts.manifest import Plan, PlannedFile
from runtime_agent.artifacts.verify import HashingWriter


class FetchKind(StrEnum):
    NOT_FOUND = "NotFound"  # no such repository, revision, bucket, object or path
    AUTH = "Unauthorized"  # credentials missing or refused
    NETWORK = "Network"  # the source did not answer, or the connection broke: try again
    CHANGED = "SourceChanged"  # the file changed since the plan; the partial copy was dropped
    CHECKSUM = "ChecksumMismatch"  # bytes arrived, but not the bytes the source announced
    DISK = "DiskFull"  # no room, before the download or during it
    REFUSED = "Refused"  # outside what the cache may read (a local path outside the roots)
    CANCELLED = "Cancelled"
    INTERRUPTED = "Interrupted"  # the agent stopped during the download


class FetchError(Exception):
    def __init__(self, kind: FetchKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __str__(self) -> str:
        return f"{self.kind.value}: {super().__str__()}"


class Source(Protocol):
    def plan(self) -> Plan:
        """The artifact's files with sizes and checksums (blocking)."""
        ...

    def fetch(self, file: PlannedFile, writer: HashingWriter, offset: int) -> None:
        """Write the file's bytes from ``offset`` on into ``writer`` (blocking)."""
        ...
