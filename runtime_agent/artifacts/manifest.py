"""What the cache writes next to an entry's files: the manifest of a ready entry, the job file of
a download in progress, and the file plan both are made of.

The cache is rebuilt from these files at every start, never from memory: a ready entry is a
directory with a manifest whose files are all present with their recorded sizes; a staging
directory with a job file is a download to resume (or, when it needed the request's own
credentials, one to report as interrupted). Writes are atomic: temp file, fsync, rename,
directory fsync.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from guard.files import write_atomically

MANIFEST = "manifest.json"
JOB = "job.json"
FILES = "files"
VERSION = 1


@dataclass(frozen=True)
class PlannedFile:
    """One file of an artifact. ``checksums``: algorithm -> expected hex digest, as the source
    gave them (``sha256``, ``git-sha1``, ``sha1``, ``crc32``, ``md5``); empty: size only.
    ``locator``: where the source finds it (Hub filename, S3 key, local path); ``etag``: the
    version the plan saw, so a resumed download never mixes two versions of one file."""

    path: str
    size: int
    checksums: dict[str, str] = field(default_factory=dict)
    locator: str = ""
    etag: str | None = None


@dataclass(frozen=True)
class Plan:
    """Everything a download will fetch, fixed before the first byte moves."""

    files: tuple[PlannedFile, ...]
    resolved_revision: str | None = None  # the Hub commit a branch or tag resolved to

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class Manifest:
    """A ready entry: source, revision, files, bytes, when it was staged and last used."""

    entry_id: str
    artifact_url: str
    source: str
    revision: str | None
    resolved_revision: str | None
    files: tuple[PlannedFile, ...]
    total_bytes: int
    staged_at: float
    last_used_at: float
    verified: tuple[str, ...] = ()  # the checksum algorithms that were checked
    version: int = VERSION

    def used_at(self, when: float) -> Manifest:
        return Manifest(**{**self.__dict__, "last_used_at": when})


@dataclass(frozen=True)
class JobFile:
    """A download in progress. ``resumable``: it needs no secret from its request, so a restarted
    agent goes on with it; ``failed``: why it stopped, if it did."""

    entry_id: str
    artifact_url: str
    source: str
    revision: str | None
    resumable: bool
    started_at: float
    plan: Plan | None = None
    failed: str | None = None


def _plan_from(data: Any) -> Plan | None:
    if data is None:
        return None
    files = tuple(PlannedFile(**f) for f in data["files"])
    return Plan(files, data.get("resolved_revision"))


def manifest_from(data: dict[str, Any]) -> Manifest:
    files = tuple(PlannedFile(**f) for f in data["files"])
    fields = {k: v for k, v in data.items() if k != "files"}
    fields["verified"] = tuple(fields.get("verified", ()))
    return Manifest(files=files, **fields)


def job_from(data: dict[str, Any]) -> JobFile:
    fields = {k: v for k, v in data.items() if k != "plan"}
    return JobFile(plan=_plan_from(data.get("plan")), **fields)


def to_json(value: Manifest | JobFile) -> dict[str, Any]:
    return asdict(value)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace ``path`` (blocking: call in a thread)."""
    write_atomically(path, json.dumps(data, indent=1, sort_keys=True).encode())


def read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data
