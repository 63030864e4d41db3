"""Sources: the periodic resync, the manifest directory and an agent's events feed."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from aiohttp import web

from reconciler.runtime.sources import (
    DirectorySource,
    Event,
    EventFeedSource,
    TimerSource,
)
from runtime_agent.api.app import make_app
from runtime_agent.api.events import EventLog
from runtime_agent.api.limits import Slots
from runtime_agent.supervision.views import EngineEvent
from tests.clocks import FakeClock

pytestmark = [pytest.mark.timeout(30), pytest.mark.loop_guard]


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


class Inbox:
    """A queue stand-in that keeps every key in arrival order and lets a test await them."""

    def __init__(self) -> None:
        self.keys: list[Hashable] = []
        self._arrived: asyncio.Queue[Hashable] = asyncio.Queue()

    def add(self, key: Hashable) -> None:
        self.keys.append(key)
        self._arrived.put_nowait(key)

    async def next(self, count: int, timeout: float = 10.0) -> list[Hashable]:
        return [await asyncio.wait_for(self._arrived.get(), timeout) for _ in range(count)]

    def pending(self) -> int:
        return self._arrived.qsize()


# -- TimerSource ----------------------------------------------------------------------------------

async def test_the_timer_enqueues_every_key_at_start_and_each_interval() -> None:
    clock = FakeClock()
    inbox = Inbox()
    models = ["a", "b"]
    source = TimerSource(clock, 60.0, lambda: list(models))
    source.start(inbox)
    await settle()
    assert inbox.keys == ["a", "b"]
    models.append("c")
    clock.advance(59.0)
    await settle()
    assert len(inbox.keys) == 2
    clock.advance(1.0)
    await settle()
    assert inbox.keys == ["a", "b", "a", "b", "c"]
    await source.stop()
    assert clock.sleepers == 0


async def test_the_timer_takes_an_async_key_list_and_survives_a_failing_one() -> None:
    clock = FakeClock()
    inbox = Inbox()
    answers: list[Exception | list[str]] = [RuntimeError("listing failed"), ["x"]]

    async def keys() -> Iterable[str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    source = TimerSource(clock, 10.0, keys)
    source.start(inbox)
    await settle()
    assert inbox.keys == []
    clock.advance(10.0)
    await settle()
    assert inbox.keys == ["x"]
    await source.stop()


# -- DirectorySource ------------------------------------------------------------------------------

Change = tuple[str, str | None, str | None]
Key = tuple[str, str, str]


def manifest_keys(changes: list[Change]) -> Callable[[Path, str | None, str | None], list[Key]]:
    """A ``to_keys`` that records each change and maps a manifest to its ModelClaim key."""

    def to_keys(path: Path, old: str | None, new: str | None) -> list[Key]:
        changes.append((path.name, old, new))
        keys = []
        for text in (old, new):
            if text is not None:
                meta = yaml.safe_load(text)["metadata"]
                keys.append(("ModelClaim", meta.get("namespace", "default"), meta["name"]))
        return sorted(set(keys))

    return to_keys


def claim_yaml(name: str, replicas: int = 1) -> str:
    return f"kind: ModelClaim\nmetadata:\n  name: {name}\nspec:\n  replicas: {replicas}\n"


async def test_the_directory_reports_created_modified_and_deleted_manifests(
        tmp_path: Path) -> None:
    changes: list[Change] = []
    inbox = Inbox()
    source = DirectorySource(tmp_path, manifest_keys(changes), interval=60.0)
    (tmp_path / "qwen.yaml").write_text(claim_yaml("qwen"))
    await source.poll(inbox)
    assert changes == [("qwen.yaml", None, claim_yaml("qwen"))]
    assert inbox.keys == [("ModelClaim", "default", "qwen")]

    (tmp_path / "qwen.yaml").write_text(claim_yaml("qwen", replicas=2))  # same size, same tick
    await source.poll(inbox)
    assert changes[-1] == ("qwen.yaml", claim_yaml("qwen"), claim_yaml("qwen", 2))

    (tmp_path / "qwen.yaml").write_text(claim_yaml("llama", 2))  # renamed object: both keys
    await source.poll(inbox)
    assert inbox.keys[-2:] == [("ModelClaim", "default", "llama"),
                               ("ModelClaim", "default", "qwen")]

    (tmp_path / "qwen.yaml").unlink()
    await source.poll(inbox)
    assert changes[3] == ("qwen.yaml", claim_yaml("llama", 2), None)
    assert inbox.keys[-1] == ("ModelClaim", "default", "llama")
    await source.poll(inbox)
    assert len(changes) == 4


async def test_the_directory_ignores_touches_hidden_files_and_other_suffixes(
        tmp_path: Path) -> None:
    changes: list[Change] = []
    (tmp_path / "a.yml").write_text(claim_yaml("a"))
    (tmp_path / ".a.yaml.swp").write_text("junk")
    (tmp_path / "notes.txt").write_text("junk")
    source = DirectorySource(tmp_path, manifest_keys(changes), interval=60.0)
    inbox = Inbox()
    await source.poll(inbox)
    assert [c[0] for c in changes] == ["a.yml"]
    later = time.time_ns() + 5_000_000_000  # a touch: new mtime, same text
    os.utime(tmp_path / "a.yml", ns=(later, later))
    await source.poll(inbox)
    assert len(changes) == 1


async def test_a_file_rewritten_in_place_is_seen_by_the_sweep_once_a_second(
        tmp_path: Path) -> None:
    """An idle poll only stats the directory; a rewrite in place (the directory's mtime
    unchanged, the file past its racy window) waits for the once-a-second sweep."""
    changes: list[Change] = []
    clock = FakeClock()
    path = tmp_path / "a.yaml"
    path.write_text(claim_yaml("a"))
    past = time.time_ns() - 10_000_000_000
    for p in (path, tmp_path):  # nothing racy: all of it written ten seconds ago
        os.utime(p, ns=(past, past))
    source = DirectorySource(tmp_path, manifest_keys(changes), interval=0.05, clock=clock)
    inbox = Inbox()
    await source.poll(inbox)
    assert len(changes) == 1
    path.write_text(claim_yaml("a", 2))  # in place: the directory's entries are the same
    os.utime(path, ns=(past + 1_000_000, past + 1_000_000))
    os.utime(tmp_path, ns=(past, past))
    clock.advance(0.5)
    await source.poll(inbox)
    assert len(changes) == 1  # not swept yet
    clock.advance(0.5)
    await source.poll(inbox)
    assert changes[-1] == ("a.yaml", claim_yaml("a"), claim_yaml("a", 2))


async def test_a_bad_manifest_is_logged_and_the_others_still_arrive(tmp_path: Path) -> None:
    changes: list[Change] = []
    (tmp_path / "bad.yaml").write_text("metadata: [")
    (tmp_path / "good.yaml").write_text(claim_yaml("good"))
    source = DirectorySource(tmp_path, manifest_keys(changes), interval=60.0)
    inbox = Inbox()
    await source.poll(inbox)
    assert inbox.keys == [("ModelClaim", "default", "good")]


async def test_the_running_directory_source_sees_files_come_change_and_go(
        tmp_path: Path) -> None:
    changes: list[Change] = []
    (tmp_path / "early.yaml").write_text(claim_yaml("early"))
    source = DirectorySource(tmp_path, manifest_keys(changes), interval=0.01)
    inbox = Inbox()
    source.start(inbox)
    try:
        assert await inbox.next(1) == [("ModelClaim", "default", "early")]  # present at start
        (tmp_path / "late.yaml").write_text(claim_yaml("late"))
        assert await inbox.next(1) == [("ModelClaim", "default", "late")]
        (tmp_path / "early.yaml").write_text(claim_yaml("early", 3))
        assert await inbox.next(1) == [("ModelClaim", "default", "early")]
        (tmp_path / "late.yaml").unlink()
        assert await inbox.next(1) == [("ModelClaim", "default", "late")]
    finally:
        await source.stop()
    assert [(name, old is None, new is None) for name, old, new in changes] == [
        ("early.yaml", True, False), ("late.yaml", True, False),
        ("early.yaml", False, False), ("late.yaml", False, True)]


# -- EventFeedSource ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class FeedServer:
    """The agent's real events handler over a bare ``EventLog``, on a port that survives
    restarts (stop and start again: the "agent" drops every connection in between)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = EventLog()
        self._runner: web.AppRunner | None = None

    def emit(self, model: str) -> None:
        self.log.append(EngineEvent(at=time.time(), model_name=model, engine_id=f"e-{model}",
                                    src="booting", dst="active", reason="Ready", message=""))

    async def start(self) -> None:
        agent = SimpleNamespace(events=self.log, waiters=Slots(16, "long-polls"),
                                streams=Slots(4, "streams"))
        runner = web.AppRunner(make_app(agent), shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._runner = runner

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@pytest.fixture
async def server() -> AsyncIterator[FeedServer]:
    feed = FeedServer()
    await feed.start()
    yield feed
    await feed.stop()


def model_of(event: Event) -> list[str]:
    return [str(event["model"])]


def follow(server: FeedServer, inbox: Inbox) -> EventFeedSource[Hashable]:
    source: EventFeedSource[Hashable] = EventFeedSource(
        server.url, model_of, on_connect=lambda: inbox.add("RESYNC"), wait=5,
        retry_base=0.01, retry_cap=0.2)
    source.start(inbox)
    return source


async def test_the_feed_delivers_only_new_events_in_order(server: FeedServer) -> None:
    server.emit("old-1")
    server.emit("old-2")
    inbox = Inbox()
    source = follow(server, inbox)
    try:
        assert await inbox.next(1) == ["RESYNC"]
        for name in ("m1", "m2", "m3"):
            server.emit(name)
        assert await inbox.next(3) == ["m1", "m2", "m3"]
        assert source.cursor == 5 and source.connects == 1
    finally:
        await source.stop()


async def test_the_feed_reconnects_after_the_agent_drops_and_resumes_from_its_cursor(
        server: FeedServer) -> None:
    inbox = Inbox()
    source = follow(server, inbox)
    try:
        assert await inbox.next(1) == ["RESYNC"]
        server.emit("a")
        assert await inbox.next(1) == ["a"]
        await server.stop()
        server.emit("b")  # happened while nobody could ask
        server.emit("c")
        await server.start()
        assert await inbox.next(3) == ["RESYNC", "b", "c"]
        server.emit("d")
        assert await inbox.next(1) == ["d"]
        assert source.connects == 2 and source.cursor == 4
    finally:
        await source.stop()


async def test_an_agent_that_restarted_with_a_fresh_feed_is_followed_from_its_new_cursor(
        server: FeedServer) -> None:
    inbox = Inbox()
    source = follow(server, inbox)
    try:
        assert await inbox.next(1) == ["RESYNC"]
        for name in ("a", "b", "c"):
            server.emit(name)
        assert await inbox.next(3) == ["a", "b", "c"]
        await server.stop()
        server.log = EventLog()  # the agent restarted: its sequence starts again at 1
        server.emit("re-adopted")
        await server.start()
        assert await inbox.next(1) == ["RESYNC"]  # the resync covers what happened meanwhile
        server.emit("new")
        assert await inbox.next(1) == ["new"]
        assert source.cursor == 2
    finally:
        await source.stop()


async def test_a_restarted_agent_whose_cursor_ran_past_the_old_one_is_told_by_its_boot_id(
        server: FeedServer) -> None:
    inbox = Inbox()
    source = follow(server, inbox)
    try:
        assert await inbox.next(1) == ["RESYNC"]
        server.emit("a")
        assert await inbox.next(1) == ["a"]
        await server.stop()
        server.log = EventLog()  # restarted, and busy since: its cursor is past ours
        for name in ("r1", "r2", "r3"):
            server.emit(name)
        await server.start()
        assert await inbox.next(1) == ["RESYNC"]  # not a silent continuation at cursor 2
        assert source.boot_id == server.log.boot_id and source.cursor == 3
        server.emit("new")
        assert await inbox.next(1) == ["new"]
    finally:
        await source.stop()


async def test_events_that_fell_out_of_the_agents_ring_trigger_a_resync(
        server: FeedServer) -> None:
    server.log = EventLog(capacity=2)
    await server.stop()
    await server.start()
    inbox = Inbox()
    source = follow(server, inbox)
    try:
        assert await inbox.next(1) == ["RESYNC"]
        server.emit("a")
        assert await inbox.next(1) == ["a"]
        await server.stop()
        for name in ("b", "c", "d", "e"):
            server.emit(name)  # the ring keeps d and e only
        await server.start()
        assert await inbox.next(4) == ["RESYNC", "RESYNC", "d", "e"]
    finally:
        await source.stop()


async def test_stopping_the_feed_source_ends_its_long_poll_at_once(server: FeedServer) -> None:
    inbox = Inbox()
    source = follow(server, inbox)
    assert await inbox.next(1) == ["RESYNC"]
    await settle()
    await asyncio.wait_for(source.stop(), 2)
    server.emit("late")
    await settle()
    assert inbox.keys == ["RESYNC"]
