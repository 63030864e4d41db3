"""The events feed: every transition in order, long-poll and SSE, reconnect without loss."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading

import pytest

from tests.harness import AgentProcess

pytestmark = pytest.mark.integration


class SseReader:
    """A minimal SSE client over a raw socket (reads until told to stop)."""

    def __init__(self, agent: AgentProcess, since: int | None = None,
                 last_event_id: int | str | None = None) -> None:
        self.items: list[dict] = []
        self.gaps: list[dict] = []
        self.resets: list[dict] = []
        self.ids: list[str] = []
        self.changed = threading.Condition()
        self.sock = socket.create_connection(("127.0.0.1", agent.port), timeout=30)
        path = "/v1/runtime/events/stream" + (f"?since={since}" if since is not None else "")
        headers = f"Last-Event-ID: {last_event_id}\r\n" if last_event_id is not None else ""
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        buf = b""
        try:
            while chunk := self.sock.recv(65536):
                buf += chunk
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    self._block(block.decode(errors="replace"))
        except OSError:
            pass

    def _block(self, block: str) -> None:
        lines = block.splitlines()
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        if not data:
            return
        with self.changed:
            if "event: gap" in lines:
                self.gaps.append(json.loads(data[0]))
            elif "event: reset" in lines:
                self.resets.append(json.loads(data[0]))
            else:
                self.items.append(json.loads(data[0]))
                self.ids += [ln[4:] for ln in lines if ln.startswith("id: ")]
            self.changed.notify_all()

    def wait_count(self, n: int, timeout_s: float = 20) -> list[dict]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.items) >= n, timeout_s), self.items
            return list(self.items)

    def close(self) -> None:
        self.sock.close()


def test_the_stream_delivers_every_transition_in_order(agent: AgentProcess) -> None:
    reader = SseReader(agent, since=0)
    try:
        pid = agent.activate_sim("m1")["pid"]
        agent.wait_phase("m1", "active")
        agent.client.sleep("m1")
        agent.client.wake("m1")
        os.kill(pid, signal.SIGKILL)
        agent.wait_for(lambda s: agent.model(s, "m1")["restart_count"] == 1
                       and agent.model(s, "m1")["ready"], what="restarted")
        agent.client.deactivate("m1")
        feed = agent.client.events(0)["events"]
        streamed = reader.wait_count(len(feed))
        assert streamed == feed
        assert [e["seq"] for e in streamed] == list(range(1, len(feed) + 1))
        moves = [(e["from"], e["to"]) for e in streamed]
        assert moves == [("activating", "booting"), ("booting", "active"),
                         ("active", "sleeping"), ("sleeping", "active"),
                         ("active", "restarting"), ("restarting", "booting"),
                         ("booting", "active"), ("active", "stopping"),
                         ("stopping", "stopped")]
    finally:
        reader.close()


def test_a_reconnecting_client_misses_nothing_still_in_the_ring(agent: AgentProcess) -> None:
    first = SseReader(agent)
    agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    seen = first.wait_count(2)
    first.close()
    agent.client.sleep("m1")  # happens while the client is away
    agent.client.wake("m1")
    again = SseReader(agent, last_event_id=seen[-1]["seq"])
    try:
        rest = again.wait_count(2)
        assert [e["seq"] for e in seen + rest] == [1, 2, 3, 4]
        assert [e["to"] for e in rest] == ["sleeping", "active"]
        assert again.gaps == []
    finally:
        again.close()


def test_a_cursor_from_an_earlier_boot_is_told_to_relist_then_gets_this_boots_events(
        agent: AgentProcess) -> None:
    agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    boot = agent.client.events(0)["boot_id"]
    reader = SseReader(agent, last_event_id="an-earlier-boot:7")
    try:
        items = reader.wait_count(2)
        assert reader.resets == [{"boot_id": boot, "message": "the agent restarted: re-list"}]
        assert [e["seq"] for e in items] == [1, 2]
        assert reader.ids == [f"{boot}:1", f"{boot}:2"]  # what a reconnect sends back
    finally:
        reader.close()


@pytest.mark.parametrize("cursor", ["\u00b2", "\u0661", "9" * 5000, "-1", "2.0"])
def test_a_cursor_that_is_not_a_plain_number_is_ignored_not_a_server_error(
        agent: AgentProcess, cursor: str) -> None:
    """``"²".isdigit()`` is true and ``int("²")`` raises; 5,000 digits are more than ``int()``
    reads. Such a Last-Event-ID once answered 500; it is a cursor the agent does not know, so the
    stream starts from the beginning."""
    agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    reader = SseReader(agent, last_event_id=cursor)
    try:
        assert [e["seq"] for e in reader.wait_count(2)] == [1, 2]
    finally:
        reader.close()


def test_long_poll_returns_as_soon_as_something_happens(agent: AgentProcess) -> None:
    cursor = agent.client.events(0)["cursor"]
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.update(agent.client.events(cursor, wait=30)))
    waiter.start()
    agent.activate_sim("m1")
    waiter.join(10)
    assert not waiter.is_alive()
    assert result["events"][0]["to"] == "booting"


def test_the_ring_keeps_the_newest_events_and_reports_where_it_starts() -> None:
    from runtime_agent.api.events import EventLog
    from runtime_agent.supervision.views import EngineEvent

    log = EventLog(capacity=3)
    assert log.first_seq == 1 and log.since(0) == []
    for i in range(5):
        log.append(EngineEvent(at=float(i), model_name="m", engine_id="e", src="a", dst="b",
                               reason="r", message=str(i)))
    assert [e["seq"] for e in log.since(0)] == [3, 4, 5]
    assert log.first_seq == 3 and log.last_seq == 5
    assert [e["message"] for e in log.since(4)] == ["4"]


def test_engine_logs_are_served_by_model_name(agent: AgentProcess) -> None:
    agent.activate_sim("Qwen/Qwen3-0.6B")
    agent.wait_phase("Qwen/Qwen3-0.6B", "active")
    lines = agent.client.logs("Qwen/Qwen3-0.6B", 50)["lines"]
    assert any("engine start" in line for line in lines)
    assert any("startup complete" in line.lower() for line in lines)


def test_the_agent_logs_json_lines_with_the_model_on_engine_lines(agent_factory) -> None:
    agent: AgentProcess = agent_factory(extra_args=["--log-format", "json"])
    agent.activate_sim("m1")
    agent.wait_phase("m1", "active")
    lines = [json.loads(line) for line in agent.log_path.read_text().splitlines()
             if line.startswith("{")]
    assert lines and all({"ts", "level", "logger", "msg"} <= line.keys() for line in lines)
    transitions = [line for line in lines if "event" in line]
    assert [t["event"]["to"] for t in transitions] == ["booting", "active"]
    assert all(t["model"] == "m1" for t in transitions)
