"""``runtime-agent top``: a live view of one node, refreshed from the agent's events feed.

It follows the agent's events stream (``HttpAgentClient.stream``: Server-Sent Events; a
reconnect sends the last ``BOOT:SEQ`` it saw, and an agent that restarted answers ``reset``,
which the view says) and reads the snapshot again after every event, and every few seconds for
the request figures that change without one. The screen: a headline saying whether engines and GPU memory are real or
simulated, each card's memory as a bar split by engine (``runtime_agent.console.nodeview``),
and a table of engines. Keys act on the selected engine through the same HTTP client the
reconciler uses (``agent_client.HttpAgentClient``): ``s`` sleep, ``w`` wake, ``x`` stop
(then ``y`` to confirm), ``r`` refresh, ``q`` quit. Built on Textual.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Static

from agent_client import AgentUnreachable, HttpAgentClient, Reply, client_token
from guard.tokens import TokenError
from runtime_agent.console import nodeview
from runtime_agent.preflight import EXIT_UNREADABLE

BAR_WIDTH = 60
FIGURES_EVERY_S = 2.0


class NodeView(App[int]):
    CSS = """
    #headline { height: auto; padding: 0 1; text-style: bold; }
    #cards { height: auto; padding: 0 1; }
    #status { height: auto; padding: 0 1; color: $warning; }
    DataTable { height: 1fr; }
    """
    BINDINGS = [
        Binding("s", "sleep", "sleep"),
        Binding("w", "wake", "wake"),
        Binding("x", "stop", "stop"),
        Binding("y", "confirm", "confirm", show=False),
        Binding("r", "refresh", "refresh"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, url: str, token: str | None) -> None:
        super().__init__()
        self.url = url
        self._token = token
        self._session: aiohttp.ClientSession | None = None
        self._client: HttpAgentClient | None = None
        self._snapshot: dict[str, Any] = {}
        self._last_events: dict[str, str] = {}
        self._names: list[str] = []
        self._dirty = True
        self._pending_stop: str | None = None

    def compose(self) -> ComposeResult:
        yield Static("connecting to " + self.url, id="headline")
        yield Static("", id="cards")
        yield DataTable(id="engines", cursor_type="row", zebra_stripes=True)
        yield Static("", id="status")
        yield Footer()

    async def on_mount(self) -> None:
        self.title = "runtime-agent top"
        self._session = aiohttp.ClientSession()
        self._client = HttpAgentClient(self.url, self._session, token=self._token)
        self.query_one(DataTable).add_columns(*nodeview.COLUMNS)
        self.run_worker(self._follow(), exclusive=False, group="feed")
        self.set_interval(0.25, self._refresh_if_dirty)
        self.set_interval(FIGURES_EVERY_S, self._mark_dirty)

    async def on_unmount(self) -> None:
        if self._session is not None:
            await self._session.close()

    # ---- the feed ---------------------------------------------------------------------------

    async def _follow(self) -> None:
        assert self._client is not None
        last_id: str | None = None
        pause = 0.5
        while True:
            try:
                async with self._client.stream(last_id) as events:
                    pause = 0.5
                    self._say("")
                    async for event in events:
                        last_id = event.id or last_id
                        self._on_event(event.event, event.data)
            except AgentUnreachable as exc:
                self._say(f"cannot follow {self.url}: {str(exc) or type(exc).__name__}; "
                          "trying again")
            await asyncio.sleep(pause)
            pause = min(5.0, pause * 2)

    def _on_event(self, kind: str, data: str) -> None:
        item = json.loads(data)
        if kind == "reset":
            self._last_events.clear()
            self._say(f"the agent restarted (boot {item.get('boot_id')}): showing it afresh")
        elif kind == "message" and item.get("model"):
            self._last_events[item["model"]] = nodeview.event_summary(item)
        self._dirty = True

    def _mark_dirty(self) -> None:
        self._dirty = True

    async def _refresh_if_dirty(self) -> None:
        if not self._dirty or self._client is None:
            return
        self._dirty = False
        try:
            self._snapshot = await self._client.snapshot()
        except AgentUnreachable as exc:
            self._say(f"cannot read the snapshot: {exc}")
            return
        self._draw()

    # ---- drawing ----------------------------------------------------------------------------

    def _draw(self) -> None:
        snap = self._snapshot
        self.query_one("#headline", Static).update(nodeview.headline(snap, self.url))
        models = snap.get("models", [])
        simulated = snap.get("node", {}).get("gpu_backend") == "simulated"
        lines = Text()
        for gpu in snap.get("accelerators", []):
            segments = nodeview.card_segments(gpu, models)
            lines.append(nodeview.card_title(gpu, simulated) + "\n")
            lines.append_text(Text.assemble(*nodeview.bar(segments, BAR_WIDTH)))
            lines.append("\n")
            lines.append_text(Text.assemble(*nodeview.legend(segments)))
            lines.append("\n")
        lines.append(f"{nodeview.KV_CHAR} KV cache in use  {nodeview.HBM_CHAR} rest of an awake "
                     f"engine  {nodeview.ASLEEP_CHAR} asleep  {nodeview.OTHER_CHAR} not "
                     f"accounted to an engine  {nodeview.FREE_CHAR} free", style="bright_black")
        self.query_one("#cards", Static).update(lines)
        table = self.query_one(DataTable)
        selected = self.selected()
        table.clear()
        rows = nodeview.engine_rows(snap, self._last_events)
        self._names = [row[0] for row in rows]
        for row in rows:
            table.add_row(*row, key=row[0])
        if selected in self._names:
            table.move_cursor(row=self._names.index(selected))

    def _say(self, message: str) -> None:
        self.query_one("#status", Static).update(message)

    def selected(self) -> str | None:
        table = self.query_one(DataTable)
        if not self._names or table.cursor_row < 0 or table.cursor_row >= len(self._names):
            return None
        return self._names[table.cursor_row]

    # ---- keys -------------------------------------------------------------------------------

    def action_sleep(self) -> None:
        self._act("sleep")

    def action_wake(self) -> None:
        self._act("wake")

    def action_stop(self) -> None:
        name = self.selected()
        if name is not None:
            self._pending_stop = name
            self._say(f"stop {name}'s engine (its whole process tree)? press y to confirm")

    def action_confirm(self) -> None:
        if self._pending_stop is not None:
            self._act("stop", self._pending_stop)
            self._pending_stop = None

    def action_refresh(self) -> None:
        self._dirty = True

    def _act(self, action: str, name: str | None = None) -> None:
        name = name or self.selected()
        if name is None or self._client is None:
            self._say("no engine selected")
            return
        self._say(f"{action} {name}...")
        self.run_worker(self._call(action, name), group="actions")

    async def _call(self, action: str, name: str) -> None:
        assert self._client is not None
        calls: dict[str, Callable[[str], Awaitable[Reply]]] = {
            "sleep": self._client.sleep, "wake": self._client.wake,
            "stop": self._client.deactivate}
        try:
            reply = await calls[action](name)
        except AgentUnreachable as exc:
            self._say(f"{action} {name}: cannot reach the agent ({exc})")
            return
        outcome = "done" if reply.ok else f"refused ({reply.status}): {reply.message}"
        self._say(f"{action} {name}: {outcome}")
        self._dirty = True


def run_top(args: argparse.Namespace) -> int:
    try:
        source = client_token(args.token_file, os.environ)
    except TokenError as exc:
        print(f"runtime-agent top: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    NodeView(args.url, source.token() if source is not None else None).run()
    return 0
