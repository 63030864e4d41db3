"""Sources: the tasks that put keys on a controller's queue.

A source turns "something may have changed" into keys and never says what changed: the
reconciler reads the current state itself. Three kinds:

- ``TimerSource``: every ``interval`` seconds, all keys (the periodic resync that repairs
  anything a missed notification left behind);
- ``DirectorySource``: a directory of YAML manifests, polled; each created, modified or deleted
  file is mapped to keys by ``to_keys(path, old_text, new_text)`` (a deleted file passes its old
  text, so the objects it described are reconciled into their absence);
- ``EventFeedSource``: an agent's events long-poll feed (``agent_client``), each event mapped
  to keys by ``to_keys(event)``.

Each is one asyncio task: ``start(queue)`` creates it, ``stop()`` cancels it and waits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import aiohttp

from agent_client import AgentUnreachable, EventsPage, FeedError, HttpAgentClient
from contract.clock import Clock, LoopClock
from reconciler.runtime.queue import Enqueuer, K_contra
from reconciler.runtime.ratelimit import backoff_delay

log = logging.getLogger("reconciler.runtime.sources")

K = TypeVar("K", bound=Hashable)
K_co = TypeVar("K_co", bound=Hashable, covariant=True)

KeysFn = Callable[[], "Iterable[K] | Awaitable[Iterable[K]]"]
OnConnect = Callable[[], "None | Awaitable[None]"]


class Source(Protocol[K_co]):
    def start(self, queue: Enqueuer[K_co]) -> None: ...

    async def stop(self) -> None: ...


class _TaskSource(Generic[K]):
    """One task per source: ``start`` creates it, ``stop`` cancels it and waits for it."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    def start(self, queue: Enqueuer[K]) -> None:
        if self._task is not None:
            raise RuntimeError(f"{type(self).__name__} is already started")
        self._task = asyncio.get_running_loop().create_task(self._run(queue),
                                                            name=type(self).__name__)
        self._task.add_done_callback(_log_crash)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])  # not ``await task``: our own cancellation must propagate

    async def _run(self, queue: Enqueuer[K]) -> None:
        raise NotImplementedError


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("source %s died", task.get_name(), exc_info=task.exception())


def _enqueue(queue: Enqueuer[K], keys: Iterable[K]) -> int:
    count = 0
    for key in keys:
        queue.add(key)
        count += 1
    return count


class DelayedEnqueuer(Enqueuer[K_contra], Protocol[K_contra]):
    def add_after(self, key: K_contra, delay: float) -> None: ...


class TimerSource(_TaskSource[K]):
    """All keys at start and then every ``interval`` seconds.

    With ``spread``, the later rounds hand the keys out evenly over the interval (the queue's
    ``add_after``) instead of all at once: a resync of ten thousand claims is then a trickle
    that never stands in front of a change, and its cost per second follows the interval."""

    def __init__(self, clock: Clock, interval: float, keys_fn: KeysFn[K], *,
                 spread: bool = False) -> None:
        super().__init__()
        if interval <= 0:
            raise ValueError("interval must be positive")
        self._clock = clock
        self._interval = interval
        self._keys_fn = keys_fn
        self._spread = spread

    async def _run(self, queue: Enqueuer[K]) -> None:
        first = True
        while True:
            try:
                produced = self._keys_fn()
                keys = list(await produced if isinstance(produced, Awaitable) else produced)
                add_after = getattr(queue, "add_after", None)
                if self._spread and not first and add_after is not None and keys:
                    step = self._interval / len(keys)
                    for i, key in enumerate(keys):
                        add_after(key, i * step)
                else:
                    _enqueue(queue, keys)
            except Exception:
                log.exception("resync: listing the keys failed; trying again in %.1fs",
                              self._interval)
            first = False
            await self._clock.sleep(self._interval)


# -- a directory of manifests -------------------------------------------------------------------

Signature = tuple[int, int, int]  # (mtime_ns, size, inode)
DirToKeys = Callable[[Path, "str | None", "str | None"], Iterable[K]]
DirState = Callable[[Path, "str | None"], Iterable[K]]  # the directory unreadable (why) or not
# A file changed this recently may change again within the file system's timestamp granularity
# without its signature changing (git's "racy clean" problem): such files are re-read each poll.
RACY_NS = 2_000_000_000
# Every file is stat-ed at least every max(SWEEP_EVERY_S, SWEEP_PER_FILE_S x files) seconds
# (see DirectorySource): a file rewritten in place (its directory's mtime unchanged) is seen
# within a second, or a second per thousand files past a thousand.
SWEEP_EVERY_S = 1.0
SWEEP_PER_FILE_S = 0.001


def scan_directory(directory: Path, suffixes: tuple[str, ...],
                   known: Mapping[Path, Signature]) -> dict[Path, tuple[Signature, str | None]]:
    """Blocking (run it in a thread): the manifests in ``directory`` and their signatures.

    A file's text is read when it is new, its signature changed or it is racy; otherwise it is
    None (unchanged). A file that cannot be read keeps its known signature (so it is neither
    seen as changed nor as deleted); a directory that cannot be read raises ``OSError`` (a
    failed read is never an empty one).
    """
    found: dict[Path, tuple[Signature, str | None]] = {}
    entries = list(os.scandir(directory))  # OSError: the directory cannot be read
    now_ns = time.time_ns()
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(suffixes):
            continue
        path = Path(entry.path)
        try:
            if not entry.is_file():
                continue
            st = entry.stat()
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
            racy = now_ns - st.st_mtime_ns < RACY_NS
            text = path.read_text("utf-8", errors="replace") if racy or known.get(path) != sig \
                else None
        except FileNotFoundError:
            continue  # removed since the listing: it shows up as deleted
        except OSError as err:
            log.warning("manifests: cannot read %s: %s", path, err)
            if path in known:
                found[path] = (known[path], None)
            continue
        found[path] = (sig, text)
    return found


class DirectorySource(_TaskSource[K]):
    """Polls ``path`` every ``interval`` seconds for created, modified and deleted manifests.

    Files present at start count as created. Only ``*.yaml``/``*.yml`` (``suffixes``) that are
    not hidden are watched, without subdirectories. A directory that cannot be read (removed,
    permissions) reports no change at all: ``on_unreadable(path, why)`` is told, and again with
    None once it can be read. A file whose stat changed but whose text did
    not (a touch) is not reported.
    """

    def __init__(self, path: Path | str, to_keys: DirToKeys[K], interval: float = 1.0, *,
                 clock: Clock | None = None,
                 suffixes: tuple[str, ...] = (".yaml", ".yml"),
                 sweep_per_file: float = SWEEP_PER_FILE_S, sweep_every: float = SWEEP_EVERY_S,
                 on_unreadable: DirState[K] | None = None) -> None:
        super().__init__()
        self._on_unreadable = on_unreadable
        self._missing: str | None = None
        if interval <= 0:
            raise ValueError("interval must be positive")
        self._path = Path(path)
        self._to_keys = to_keys
        self._interval = interval
        self._clock: Clock = clock or LoopClock()
        self._suffixes = suffixes
        self._known: dict[Path, tuple[Signature, str]] = {}
        self._sweep_per_file = sweep_per_file
        self._sweep_every = sweep_every
        self._dir_sig: tuple[int, int] | None = None
        self._swept_at: float | None = None
        self._newest_ns = 0  # the newest mtime among the files, at the last sweep

    async def _run(self, queue: Enqueuer[K]) -> None:
        while True:
            try:
                await self.poll(queue)
            except Exception:
                log.exception("manifests: polling %s failed", self._path)
            await self._clock.sleep(self._interval)

    def _due(self) -> bool:
        """Whether this poll must stat every file. A file created, removed or renamed into
        place (an atomic write) changes the directory's own mtime, seen every poll; a file
        rewritten in place does not, so every file is also stat-ed at least every
        ``sweep_every`` seconds or ``sweep_per_file`` x files (1 s for a thousand files), and
        every poll while a file changed within the racy window. An idle poll is then one
        ``stat`` on the loop, however many manifests there are; the sweeps, each a scan in a
        worker thread, come once a second (they came at every 50 ms poll before, and took
        about 7% of the agent's busy time under the door's load)."""
        try:
            st = os.stat(self._path)
            sig: tuple[int, int] | None = (st.st_mtime_ns, st.st_ino)
        except OSError:
            sig = None
        now, wall_ns = self._clock.now(), time.time_ns()
        newest = max([sig[0] if sig else 0, self._newest_ns])
        period = max(self._interval, self._sweep_every, self._sweep_per_file * len(self._known))
        due = (sig != self._dir_sig or wall_ns - newest < RACY_NS or self._swept_at is None
               or now - self._swept_at >= period)
        self._dir_sig = sig
        if due:
            self._swept_at = now
        return due

    async def poll(self, queue: Enqueuer[K], *, force: bool = False) -> None:
        """One look at the directory: report every change since the last look."""
        if not force and not self._due():
            return
        signatures = {path: sig for path, (sig, _) in self._known.items()}
        try:
            current = await asyncio.to_thread(scan_directory, self._path, self._suffixes,
                                              signatures)
        except OSError as err:  # gone or unreadable: nothing it declared is deleted
            why = err.strerror or type(err).__name__
            if why != self._missing:
                self._missing = why
                self._state(queue, why)
            self._swept_at = None
            return
        if self._missing is not None:
            self._missing = None
            self._state(queue, None)
        self._newest_ns = max((sig[0] for sig, _ in current.values()), default=0)
        for path in sorted(self._known.keys() - current.keys(), key=str):
            _, gone = self._known.pop(path)
            self._report(queue, path, gone, None)
        read = [(path, entry) for path, entry in current.items() if entry[1] is not None]
        for path, (sig, text) in sorted(read, key=lambda item: str(item[0])):
            assert text is not None
            before = self._known.get(path)
            self._known[path] = (sig, text)
            old = before[1] if before is not None else None
            if old != text:
                self._report(queue, path, old, text)

    def _state(self, queue: Enqueuer[K], why: str | None) -> None:
        log.warning("manifests: %s %s", self._path, f"cannot be read: {why}" if why
                    else "can be read again")
        if self._on_unreadable is not None:
            _enqueue(queue, self._on_unreadable(self._path, why))

    def _report(self, queue: Enqueuer[K], path: Path, old: str | None, new: str | None) -> None:
        change = "created" if old is None else "deleted" if new is None else "modified"
        try:
            count = _enqueue(queue, self._to_keys(path, old, new))
        except Exception:
            log.exception("manifests: mapping %s (%s) to keys failed", path, change)
            return
        log.debug("manifests: %s %s, %d keys", path, change, count)


# -- an agent's events feed ---------------------------------------------------------------------

Event = Mapping[str, Any]
EventToKeys = Callable[[Event], Iterable[K]]


class EventFeedSource(_TaskSource[K]):
    """Follows an agent's events long-poll feed (``HttpAgentClient.events_page``: the events
    after ``since``, held up to ``wait`` seconds) and enqueues each event's keys.

    On every (re)connect it learns the agent's current cursor (paging with ``wait=0`` until a
    page is empty) and calls ``on_connect`` (enqueue a resync of everything: events may have
    been missed while disconnected). The first connect starts at the agent's cursor, so only
    new events are delivered; a reconnect resumes from the last cursor seen, unless the agent's
    cursor is now behind it (the agent restarted and counts from zero again), in which case it
    starts at the agent's cursor. A gap in sequence numbers (events that fell out of the agent's
    ring) also triggers ``on_connect``. Errors reconnect after ``retry_base`` doubling up to
    ``retry_cap`` seconds; a successful poll resets the backoff.
    """

    def __init__(self, url: str, to_keys: EventToKeys[K], *, on_connect: OnConnect | None = None,
                 wait: int = 30, clock: Clock | None = None,
                 session: aiohttp.ClientSession | None = None,
                 retry_base: float = 0.5, retry_cap: float = 30.0) -> None:
        super().__init__()
        if not 0 < wait <= 60:
            raise ValueError("wait must be 1 to 60 seconds (the agent's limit)")
        self._url = url.rstrip("/")
        self._to_keys = to_keys
        self._on_connect = on_connect
        self._wait = wait
        self._clock: Clock = clock or LoopClock()
        self._session = session
        self._retry = (retry_base, retry_cap)
        self.cursor: int | None = None
        self.boot_id: str | None = None  # the agent's boot the cursor counts in
        self.connects = 0

    async def _run(self, queue: Enqueuer[K]) -> None:
        session = self._session or aiohttp.ClientSession()
        agent = HttpAgentClient(self._url, session)
        failures = 0
        try:
            while True:
                try:
                    await self._connect(agent)
                    while True:
                        await self._poll(agent, queue)
                        failures = 0
                except Exception as err:
                    delay = backoff_delay(failures, *self._retry)
                    failures += 1
                    expected = isinstance(err, AgentUnreachable)
                    log.warning("events feed %s: %s; reconnecting in %.2fs", self._url,
                                str(err) or type(err).__name__, delay,
                                exc_info=None if expected else err)
                    await self._clock.sleep(delay)
        finally:
            if self._session is None:
                await session.close()

    async def _connect(self, agent: HttpAgentClient) -> None:
        head, boot = 0, None
        while True:  # pages of at most the agent's limit; stop when the cursor stops moving
            page = await self._fetch(agent, head, 0)
            boot = page.boot_id
            if page.cursor <= head:
                break
            head = page.cursor
        restarted = boot is not None and self.boot_id is not None and boot != self.boot_id
        if self.cursor is None or head < self.cursor or restarted:
            if self.cursor is not None:
                log.warning("events feed %s: the agent restarted (cursor %d, now %d); "
                            "resyncing", self._url, self.cursor, head)
            self.cursor = head
        self.boot_id = boot
        self.connects += 1
        log.info("events feed %s: connected at cursor %d (agent at %d)", self._url,
                 self.cursor, head)
        await self._resync()

    async def _poll(self, agent: HttpAgentClient, queue: Enqueuer[K]) -> None:
        assert self.cursor is not None
        page = await self._fetch(agent, self.cursor, self._wait)
        if page.boot_id is not None and self.boot_id is not None and page.boot_id != self.boot_id:
            raise FeedError("the agent restarted (a new boot id): reconnecting to re-list")
        for event in page.events:
            seq = int(event["seq"])
            if seq <= self.cursor:
                continue
            if seq > self.cursor + 1:
                log.warning("events feed %s: events %d to %d were missed; resyncing", self._url,
                            self.cursor + 1, seq - 1)
                await self._resync()
            self.cursor = seq
            try:
                _enqueue(queue, self._to_keys(event))
            except Exception:
                log.exception("events feed %s: mapping event %d to keys failed", self._url, seq)

    async def _resync(self) -> None:
        if self._on_connect is None:
            return
        try:
            outcome = self._on_connect()
            if outcome is not None:
                await outcome
        except Exception:
            log.exception("events feed %s: on_connect failed", self._url)

    async def _fetch(self, agent: HttpAgentClient, since: int, wait: int) -> EventsPage:
        return await agent.events_page(since, wait, self.boot_id, timeout_s=15)
