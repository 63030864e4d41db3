"""Artifact URLs as the weight cache reads them: which source, which entry, and what is refused.

One artifact is one cache entry. ``hf://org/name`` and ``huggingface://org/name`` name the same
entry, a trailing ``/`` changes nothing, and a Hub revision is part of the entry (``main`` and a
pinned commit are two entries). Everything here is pure text work; whether a local path exists
(and where its symlinks lead) is ``local_path_problem``'s question: the guard's one rule for
local paths (``guard.paths``), answered on the disk.
"""

from __future__ import annotations

import hashlib
import os
import re
from enum import StrEnum
from pathlib import Path

from msgspec import Struct

from guard.paths import Refused, judge_local_path

SUPPORTED = ("huggingface://ORG/NAME, hf://ORG/NAME, s3://BUCKET/KEY-OR-PREFIX, "
             "file:///PATH or an absolute path inside the allowed local roots")
DEFAULT_REVISION = "main"
_HUB_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")
_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


class SourceKind(StrEnum):
    HUB = "huggingface"
    S3 = "s3"
    LOCAL = "local"


class ArtifactRequestError(Exception):
    """A request the cache refuses; ``status`` is the HTTP status that says so."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class ArtifactRef(Struct, frozen=True):
    """One artifact: where it comes from and which cache entry holds it.

    ``location``: the Hub repo id, the S3 key or prefix, or the local path. ``revision``: the
    Hub revision asked for (a branch, tag or commit); None for other sources."""

    kind: SourceKind
    url: str  # canonical: huggingface://..., s3://bucket/key, file:///path
    location: str
    bucket: str | None = None
    revision: str | None = None

    @property
    def entry_id(self) -> str:
        """A directory name: readable, and unique per (url, revision)."""
        digest = hashlib.sha256(f"{self.url}\n{self.revision or ''}".encode()).hexdigest()[:12]
        tail = self.url.split("://", 1)[1]
        slug = _SLUG.sub("-", f"{tail}@{self.revision}" if self.revision else tail).strip("-.")
        return f"{self.kind.value}-{slug[:60]}-{digest}"


def canonical_url(url: str) -> str:
    """``hf://x`` is ``huggingface://x``; a trailing '/' is no change (as the reconciler reads it)."""
    url = url.strip().rstrip("/")
    if url.startswith("hf://"):
        return "huggingface://" + url[len("hf://"):]
    return url


def parse_artifact(url: str, revision: str | None = None) -> ArtifactRef:
    """The artifact ``url`` names, or ArtifactRequestError saying what to fix."""
    if not url or any(c.isspace() or not c.isprintable() for c in url):
        raise ArtifactRequestError("artifact_url must be a URL without spaces, such as "
                                   "huggingface://Qwen/Qwen3-0.6B")
    if revision is not None and not _REVISION.fullmatch(revision):
        raise ArtifactRequestError(f"revision {revision!r} is not a branch, tag or commit name")
    canon = canonical_url(url)
    if canon.startswith("huggingface://"):
        return _hub(canon, revision)
    if revision is not None:
        raise ArtifactRequestError("revision applies to huggingface:// artifacts only")
    if canon.startswith("s3://"):
        return _s3(canon)
    if canon.startswith("file://") or canon.startswith("/"):
        return _local(canon)
    scheme = canon.split("://", 1)[0] if "://" in canon else None
    what = f"scheme {scheme}:// is not supported" if scheme else "is not a URL the cache can fetch"
    raise ArtifactRequestError(f"artifact_url {url!r} {what}; use {SUPPORTED}", 422)


def _hub(canon: str, revision: str | None) -> ArtifactRef:
    repo = canon[len("huggingface://"):]
    parts = repo.split("/")
    if not 1 <= len(parts) <= 2 or not all(_HUB_PART.fullmatch(p) for p in parts) \
            or any(".." in p for p in parts):
        raise ArtifactRequestError(f"{canon!r} does not name a Hub repository; write "
                                   "huggingface://ORG/NAME")
    return ArtifactRef(SourceKind.HUB, canon, repo, revision=revision or DEFAULT_REVISION)


def _s3(canon: str) -> ArtifactRef:
    bucket, _, key = canon[len("s3://"):].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ArtifactRequestError(f"{canon!r} does not name an S3 bucket; write "
                                   "s3://BUCKET/KEY-OR-PREFIX")
    if not key or any(p in ("", ".", "..") for p in key.split("/")):
        raise ArtifactRequestError(f"{canon!r} names no object or prefix inside bucket "
                                   f"{bucket!r}; write s3://{bucket}/PATH")
    return ArtifactRef(SourceKind.S3, canon, key, bucket=bucket)


def _local(canon: str) -> ArtifactRef:
    raw = canon[len("file://"):] if canon.startswith("file://") else canon
    if not raw.startswith("/"):
        raise ArtifactRequestError(f"{canon!r} is not an absolute path; write file:///PATH")
    path = os.path.normpath(raw)
    return ArtifactRef(SourceKind.LOCAL, "file://" + path, path)


def local_path_problem(path: str, roots: tuple[Path, ...]) -> tuple[int, str] | None:
    """Why the cache (or an engine) may not read ``path``: (status, message), or None when it
    may. The rule is the guard's (``guard.paths``), shared by every input that names a local
    file. Blocking (it resolves symlinks): call in a thread."""
    verdict = judge_local_path(path, roots)
    return (verdict.status, verdict.message) if isinstance(verdict, Refused) else None
