"""The cache on disk: where entries live, how a finished download enters, how an entry leaves.

    <weight cache dir>/.aibrix/artifacts/
        ready/<entry>/manifest.json, files/...   complete and checked: what engines start on
        staging/<entry>/job.json, files/...      a download in progress (parts named *.part)
        trash/                                   entries on their way out

A download enters ``ready/`` by one rename of its staging directory, after its manifest is
written and fsynced, so ``ready/`` never holds a partial entry, whatever moment the agent dies
at. Leaving is a rename into ``trash/`` first, so a half-deleted entry is never taken for a
whole one. Everything here blocks: the cache calls it in a thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from guard.files import fsync_dir
from runtime_agent.artifacts.manifest import (
    FILES,
    JOB,
    MANIFEST,
    JobFile,
    Manifest,
    job_from,
    manifest_from,
    read_json,
    to_json,
    write_json,
)
from runtime_agent.artifacts.transfer import bytes_on_disk, safe_path

log = logging.getLogger(__name__)


@dataclass
class Scan:
    """What a start finds: ready entries, downloads to resume or report, and what was dropped."""

    ready: list[Manifest] = field(default_factory=list)
    staged: list[tuple[JobFile, int]] = field(default_factory=list)  # with bytes on disk
    dropped: list[str] = field(default_factory=list)


class CacheDisk:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ready = root / "ready"
        self.staging = root / "staging"
        self.trash = root / "trash"

    def ready_files(self, entry_id: str) -> Path:
        return self.ready / entry_id / FILES

    def staging_dir(self, entry_id: str) -> Path:
        return self.staging / entry_id

    def prepare(self) -> None:
        for path in (self.ready, self.staging, self.trash):
            path.mkdir(parents=True, exist_ok=True)
        for leftover in self.trash.iterdir():  # deletions an earlier agent did not finish
            shutil.rmtree(leftover, ignore_errors=True)

    def scan(self) -> Scan:
        out = Scan()
        for path in sorted(self.ready.iterdir()):
            problem, manifest = self._check_ready(path)
            if manifest is not None:
                out.ready.append(manifest)
            else:
                out.dropped.append(f"{path.name}: {problem}")
                self.discard(path)
        for path in sorted(self.staging.iterdir()):
            try:
                job = job_from(read_json(path / JOB))
                on_disk = bytes_on_disk(path / FILES, job.plan) if job.plan else 0
            except (OSError, ValueError, KeyError, TypeError) as exc:
                out.dropped.append(f"{path.name}: unreadable download ({exc})")
                self.discard(path)
                continue
            out.staged.append((job, on_disk))
        return out

    def _check_ready(self, path: Path) -> tuple[str, Manifest | None]:
        try:
            manifest = manifest_from(read_json(path / MANIFEST))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"no readable manifest ({exc})", None
        if manifest.entry_id != path.name:
            return f"its manifest names entry {manifest.entry_id}", None
        for f in manifest.files:
            try:
                size = safe_path(path / FILES, f.path).stat().st_size
            except OSError:
                return f"{f.path} is missing", None
            if size != f.size:
                return f"{f.path} has {size} bytes, not {f.size}", None
        return "", manifest

    def write_job(self, job: JobFile) -> None:
        directory = self.staging_dir(job.entry_id)
        (directory / FILES).mkdir(parents=True, exist_ok=True)
        write_json(directory / JOB, to_json(job))

    def commit(self, manifest: Manifest) -> Path:
        """Move a finished, checked download into ``ready/``; the engine's path."""
        src = self.staging_dir(manifest.entry_id)
        write_json(src / MANIFEST, to_json(manifest))
        (src / JOB).unlink(missing_ok=True)
        dst = self.ready / manifest.entry_id
        if dst.exists():
            self.discard(dst)
        os.rename(src, dst)
        fsync_dir(self.ready)
        fsync_dir(self.staging)
        return dst / FILES

    def save_manifest(self, manifest: Manifest) -> None:
        write_json(self.ready / manifest.entry_id / MANIFEST, to_json(manifest))

    def discard(self, path: Path) -> None:
        """Remove an entry or a download: out of sight by a rename first, then deleted."""
        if not path.exists():
            return
        gone = self.trash / f"{path.name}.{uuid.uuid4().hex[:8]}"
        os.rename(path, gone)
        fsync_dir(path.parent)
        shutil.rmtree(gone, ignore_errors=True)

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize
