"""The weight cache: one entry per artifact, downloads started or joined, disk kept in bounds.

Requests for an artifact that is downloading join its transfer (one transfer per entry). A
download plans first (files, sizes, checksums), checks the disk, evicts least-recently-used
entries that no engine uses when room is needed, then runs in a worker thread while the event
loop samples its progress. Decisions that must not interleave (join or start; room and the
bytes promised to it; which entries are evicted) are made with no await in between, so the
cache needs no lock. The state on disk is the truth: ``start`` rebuilds every entry from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric

from contract.quantity import gib

from runtime_agent.artifacts.entries import (
    ArtifactEvent,
    Entry,
    EntryState,
    Job,
    Tallies,
    metric_families,
)
from runtime_agent.artifacts.manifest import (
    FILES,
    JOB,
    JobFile,
    Manifest,
    job_from,
    read_json,
)
from runtime_agent.artifacts.planning import Evictable, Rate, make_room
from runtime_agent.artifacts.sources.base import FetchError, FetchKind, Source
from runtime_agent.artifacts.store import CacheDisk
from runtime_agent.artifacts.transfer import bytes_on_disk, drop_stale, transfer
from runtime_agent.artifacts.urls import (
    ArtifactRef,
    ArtifactRequestError,
    SourceKind,
    local_path_problem,
    parse_artifact,
)

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 5.0


@dataclass(frozen=True)
class CacheConfig:
    cache_dir: Path  # AIBRIX_WEIGHT_CACHE_DIR; entries live under .aibrix/artifacts in it
    reserve_bytes: int = 1 << 30  # always left free on the cache's disk
    local_roots: tuple[Path, ...] = ()  # local paths the cache may copy from
    hf_endpoint: str | None = None
    hf_token: str | None = None
    s3_endpoint_url: str | None = None
    sample_interval_s: float = 1.0  # progress and rate sampling
    event_interval_s: float = 5.0  # progress events at most this often per download

    @property
    def root(self) -> Path:
        return self.cache_dir / ".aibrix" / "artifacts"


SourceFactory = Callable[[ArtifactRef, Mapping[str, str]], Source]
# (model name, artifact URL, revision) of every engine that may read its weights now.
Users = Callable[[], Iterable[tuple[str, str, str | None]]]


def _load_clients() -> None:
    """Import the source libraries ahead of the first download (about a second of CPU)."""
    import boto3  # noqa: F401
    import huggingface_hub  # noqa: F401


def real_sources(config: CacheConfig) -> SourceFactory:
    def make(ref: ArtifactRef, credentials: Mapping[str, str]) -> Source:
        from runtime_agent.artifacts.sources.hub import HubSource
        from runtime_agent.artifacts.sources.local import LocalSource
        from runtime_agent.artifacts.sources.s3 import S3Source

        if ref.kind is SourceKind.HUB:
            return HubSource(ref.location, ref.revision or "main", config.hf_endpoint,
                             credentials.get("HF_TOKEN") or config.hf_token)
        if ref.kind is SourceKind.S3:
            assert ref.bucket is not None
            return S3Source(ref.bucket, ref.location, config.s3_endpoint_url, credentials)
        return LocalSource(ref.location, config.local_roots)

    return make


class ArtifactCache:
    def __init__(self, config: CacheConfig, *, users: Users = lambda: (),
                 on_event: Callable[[ArtifactEvent], None] = lambda e: None,
                 sources: SourceFactory | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._users = users
        self._on_event = on_event
        self._sources = sources or real_sources(config)
        self._clock = clock
        self._disk = CacheDisk(config.root)
        self._entries: dict[str, Entry] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._closing = False
        self.tallies = Tallies()

    # ---- life -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Rebuild every entry from the disk; go on with downloads a restart interrupted."""
        await asyncio.to_thread(self._disk.prepare)
        scan = await asyncio.to_thread(self._disk.scan)
        for reason in scan.dropped:
            log.warning("weight cache: dropped %s", reason)
        for manifest in scan.ready:
            with contextlib.suppress(ArtifactRequestError):
                ref = parse_artifact(manifest.artifact_url, manifest.revision)
                self._entries[ref.entry_id] = Entry(ref, EntryState.READY, manifest=manifest)
        for job, on_disk in scan.staged:
            try:
                ref = parse_artifact(job.artifact_url, job.revision)
            except ArtifactRequestError:
                continue
            entry = Entry(ref, EntryState.FAILED, resumable=True)
            entry.progress.total = job.plan.total_bytes if job.plan else 0
            entry.progress.done = on_disk
            self._entries[ref.entry_id] = entry
            if job.failed:
                entry.error, entry.reason = job.failed, job.failed.split(":", 1)[0]
            elif not job.resumable:
                entry.error = (f"{FetchKind.INTERRUPTED.value}: the agent stopped during the "
                               "download, which used its request's own credentials; ask again "
                               "(POST /v1/model/download) to resume from the bytes on disk")
                entry.reason = FetchKind.INTERRUPTED.value
            else:
                self._begin(entry.ref, entry, {}, "Resumed")
        log.info("weight cache %s: %d ready, %d downloads found", self.config.root,
                 len(scan.ready), len(scan.staged))

    def preload_clients(self) -> None:
        """Import the source libraries in a worker thread, so the first download starts at
        once. The agent calls it after its engines are taken back: the imports hold the GIL
        for about a second, which re-adoption would otherwise wait behind (32 engines: 0.6 s
        to all ready without, 1.4-1.85 s with them running beside it)."""
        self._behind(asyncio.to_thread(_load_clients))

    async def close(self) -> None:
        """Stop downloads (their bytes stay on disk, to be resumed by the next agent)."""
        self._closing = True
        tasks = [e.job.task for e in self._entries.values() if e.job is not None]
        for e in self._entries.values():
            if e.job is not None:
                e.job.cancelled.set()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        if self._background:
            await asyncio.wait(list(self._background), timeout=CLOSE_WAIT_S)

    # ---- requests ---------------------------------------------------------------------------

    async def request(self, url: str, revision: str | None = None,
                      credentials: Mapping[str, str] | None = None) -> tuple[Entry, bool]:
        """The entry for ``url``, and whether this call started a transfer (False: it was ready
        or is downloading, and the caller joins it). Raises ArtifactRequestError."""
        ref = parse_artifact(url, revision)
        if ref.kind is SourceKind.LOCAL:
            problem = await asyncio.to_thread(local_path_problem, ref.location,
                                              self.config.local_roots)
            if problem is not None:
                raise ArtifactRequestError(problem[1], problem[0])
        entry = self._entries.get(ref.entry_id)
        if entry is not None and entry.state is not EntryState.FAILED:
            return entry, False
        how = "Resumed" if entry is not None and entry.progress.done else "Started"
        return self._begin(ref, entry, dict(credentials or {}), how), True

    async def wait(self, entry: Entry) -> Entry:
        """Until ``entry`` is no longer downloading."""
        while entry.state is EntryState.DOWNLOADING and entry.job is not None:
            await asyncio.shield(entry.job.task)
        return entry

    async def delete(self, entry_id: str) -> Entry:
        """Free an entry no engine uses (cancelling its download). Raises ArtifactRequestError."""
        entry = self._entries.get(entry_id)
        if entry is None:
            raise ArtifactRequestError(f"no cache entry {entry_id!r}; GET /v1/model/list "
                                       "names them", 404)
        users = self._pinned().get(entry_id)
        if users:
            raise ArtifactRequestError(f"entry {entry_id} is in use by {', '.join(sorted(users))};"
                                       " deactivate them first", 409)
        del self._entries[entry_id]
        if entry.job is not None:
            entry.job.cancelled.set()
            await asyncio.wait([entry.job.task])
        await asyncio.to_thread(self._disk.discard, self._disk.ready / entry_id)
        await asyncio.to_thread(self._disk.discard, self._disk.staging_dir(entry_id))
        self._emit(entry, entry.state.value, "deleted", "Deleted", "freed on request")
        return entry

    def get(self, entry_id: str) -> Entry | None:
        return self._entries.get(entry_id)

    def lookup(self, url: str, revision: str | None = None) -> Entry | None:
        try:
            return self._entries.get(parse_artifact(url, revision).entry_id)
        except ArtifactRequestError:
            return None

    def path_of(self, entry: Entry) -> Path:
        return self._disk.ready_files(entry.entry_id)

    def mark_used(self, entry: Entry) -> None:
        """An engine starts on ``entry``: it becomes the most recently used (written behind)."""
        if entry.manifest is None:
            return
        entry.manifest = entry.manifest.used_at(self._clock())
        self._behind(asyncio.to_thread(self._disk.save_manifest, entry.manifest))

    # ---- readers ----------------------------------------------------------------------------

    def listing(self) -> list[dict[str, Any]]:
        pinned = self._pinned()
        return [e.item(str(self.path_of(e)) if e.state is EntryState.READY else None,
                       e.entry_id in pinned)
                for e in sorted(self._entries.values(), key=lambda e: (e.ref.url, e.entry_id))]

    def ready_urls(self) -> list[str]:
        return sorted({e.ref.url for e in self._entries.values() if e.state is EntryState.READY})

    def downloading_urls(self) -> list[str]:
        return sorted({e.ref.url for e in self._entries.values()
                       if e.state is EntryState.DOWNLOADING})

    def ready_sizes(self) -> list[dict[str, Any]]:
        return [{"artifact_url": e.ref.url, "revision": e.ref.revision,
                 "resolved_revision": e.manifest.resolved_revision, "artifact_id": e.entry_id,
                 "size_bytes": e.manifest.total_bytes}
                for e in sorted(self._entries.values(), key=lambda e: e.entry_id)
                if e.state is EntryState.READY and e.manifest is not None]

    def metric_families(self) -> Iterator[Metric]:
        return metric_families(self._entries.values(), self.tallies)

    # ---- downloads --------------------------------------------------------------------------

    def _begin(self, ref: ArtifactRef, entry: Entry | None, credentials: dict[str, str],
               how: str) -> Entry:
        now = self._clock()
        entry = entry or Entry(ref, EntryState.DOWNLOADING)
        src = entry.state.value if entry.entry_id in self._entries else "absent"
        entry.state, entry.error, entry.reason = EntryState.DOWNLOADING, None, None
        entry.started_at, entry.rate = now, Rate(now, entry.progress.done)
        entry.resumable = not credentials  # secrets are never written down, so not resumed
        self._entries[ref.entry_id] = entry
        cancelled = threading.Event()
        task = asyncio.create_task(self._download(entry, credentials, cancelled),
                                   name=f"download:{ref.entry_id}")
        entry.job = Job(task, cancelled)
        self._emit(entry, src, "downloading", how, f"{how.lower()} {ref.url}")
        return entry

    async def _download(self, entry: Entry, credentials: dict[str, str],
                        cancelled: threading.Event) -> None:
        ref, mine = entry.ref, entry.job
        try:
            source = self._sources(ref, credentials)
            plan = await asyncio.to_thread(source.plan)
            job = JobFile(entry.entry_id, ref.url, ref.kind.value, ref.revision, entry.resumable,
                          self._clock(), plan)
            on_disk = await asyncio.to_thread(self._prepare_staging, job)
            entry.progress.total, entry.progress.done = plan.total_bytes, on_disk
            need = plan.total_bytes - on_disk
            free = await asyncio.to_thread(self._disk.free_bytes)
            # From the decision to the promise and the evictions: no await.
            room = make_room(need, free, self.config.reserve_bytes, self._committed(entry),
                             self._evictable(entry))
            if not room.ok:
                raise FetchError(FetchKind.DISK, room.message)
            assert entry.job is not None
            entry.job.need, entry.job.base = need, on_disk
            victims = [self._entries.pop(v) for v in room.evict]
            for victim in victims:
                await asyncio.to_thread(self._disk.discard, self._disk.ready / victim.entry_id)
                self.tallies.evicted += 1
                self._emit(victim, "ready", "evicted", "Evicted",
                           f"least recently used; room for {ref.url}")
            verified = await self._transfer(entry, source, plan, cancelled)
            now = self._clock()
            manifest = Manifest(entry.entry_id, ref.url, ref.kind.value, ref.revision,
                                plan.resolved_revision, plan.files, plan.total_bytes,
                                staged_at=now, last_used_at=now, verified=verified)
            await asyncio.to_thread(self._disk.commit, manifest)
        except FetchError as exc:
            await self._failed(entry, exc)
            return
        except Exception as exc:  # a bug: say so on the entry, keep the agent running
            log.exception("download of %s failed", ref.url)
            await self._failed(entry, FetchError(FetchKind.NETWORK, f"agent error: {exc!r}"))
            return
        finally:
            if entry.job is mine:
                entry.job = None
        entry.manifest, entry.state = manifest, EntryState.READY
        self.tallies.completed += 1
        self.tallies.bytes_fetched += need
        self._emit(entry, "downloading", "ready", "Ready",
                   f"{gib(plan.total_bytes)} in {len(plan.files)} files, checked: "
                   f"size{''.join(', ' + v for v in verified)}")

    def _prepare_staging(self, job: JobFile) -> int:
        """Keep what an earlier try left that still matches the plan; bytes on disk (blocking)."""
        directory = self._disk.staging_dir(job.entry_id)
        assert job.plan is not None
        try:
            old = job_from(read_json(directory / JOB)).plan
        except (OSError, ValueError, KeyError, TypeError):
            old = None
            if directory.exists():  # leftovers nobody can vouch for
                self._disk.discard(directory)
        if old is not None:
            drop_stale(directory / FILES, old, job.plan)
        self._disk.write_job(job)
        return bytes_on_disk(directory / FILES, job.plan)

    async def _transfer(self, entry: Entry, source: Source, plan: Any,
                        cancelled: threading.Event) -> tuple[str, ...]:
        files = self._disk.staging_dir(entry.entry_id) / FILES
        work = asyncio.ensure_future(asyncio.to_thread(transfer, source, plan, files,
                                                       entry.progress, cancelled))
        last_event = self._clock()
        while True:
            done, _ = await asyncio.wait({work}, timeout=self.config.sample_interval_s)
            now = self._clock()
            entry.rate = (entry.rate or Rate(now, 0)).next(now, entry.progress.done)
            if done:
                return work.result()
            if now - last_event >= self.config.event_interval_s:
                last_event = now
                self._emit(entry, "downloading", "downloading", "Progress",
                           f"{gib(entry.progress.done)} of {gib(entry.progress.total)}")

    async def _failed(self, entry: Entry, exc: FetchError) -> None:
        if self._entries.get(entry.entry_id) is not entry:
            return  # deleted meanwhile
        if exc.kind is FetchKind.CANCELLED and self._closing:
            return  # the agent stops: the job file stays, the next agent resumes
        directory = self._disk.staging_dir(entry.entry_id)
        if (directory / JOB).exists():  # written down first: the state flips with no await after
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                job = job_from(read_json(directory / JOB))
                await asyncio.to_thread(self._disk.write_job, JobFile(
                    **{**job.__dict__, "failed": str(exc)}))
        if self._entries.get(entry.entry_id) is not entry:
            return
        entry.state, entry.error, entry.reason = EntryState.FAILED, str(exc), exc.kind.value
        entry.resumable = exc.kind is not FetchKind.REFUSED
        self.tallies.failed += 1
        log.warning("download of %s failed: %s", entry.ref.url, exc)
        self._emit(entry, "downloading", "failed", exc.kind.value, str(exc))

    # ---- helpers ----------------------------------------------------------------------------

    def _pinned(self) -> dict[str, set[str]]:
        """Entry id -> the engines that use it."""
        out: dict[str, set[str]] = {}
        for model, url, revision in self._users():
            with contextlib.suppress(ArtifactRequestError):
                out.setdefault(parse_artifact(url, revision).entry_id, set()).add(model)
        return out

    def _committed(self, exclude: Entry) -> int:
        return sum(e.job.remaining(e.progress) for e in self._entries.values()
                   if e.job is not None and e is not exclude)

    def _evictable(self, exclude: Entry) -> list[Evictable]:
        pinned = self._pinned()
        return [Evictable(e.entry_id, e.manifest.total_bytes, e.manifest.last_used_at)
                for e in self._entries.values()
                if e.state is EntryState.READY and e.manifest is not None and e is not exclude
                and e.entry_id not in pinned]

    def _emit(self, entry: Entry, src: str, dst: str, reason: str, message: str) -> None:
        self._on_event(ArtifactEvent(self._clock(), entry.entry_id, entry.ref.url, src, dst,
                                     reason, message, entry.progress.done,
                                     entry.progress.total))

    def _behind(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
