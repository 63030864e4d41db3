"""What the pool awaits of an owner: three futures, each set once.

``spawned``: the first process started (None) or could not (why). ``answered``: an activation
can be answered: the process started, or could not, or the start waits (for its turn on its
cards, the weight cache, its port), which the view says; an activation answers then, never
later (issue 26). ``settled``: the engine's first state is known (ready, gone, failed, stopped).
"""

from __future__ import annotations

import asyncio


class Promises:
    def __init__(self) -> None:
        running = asyncio.get_running_loop()
        self.spawned: asyncio.Future[str | None] = running.create_future()
        self.answered: asyncio.Future[str | None] = running.create_future()
        self.spawned.add_done_callback(lambda f: self.answer(f.result()))
        self.settled: asyncio.Future[None] = running.create_future()

    def started(self, error: str | None) -> None:
        """The first start's outcome: None, or why it could not start."""
        if not self.spawned.done():
            self.spawned.set_result(error)

    def answer(self, error: str | None) -> None:
        if not self.answered.done():
            self.answered.set_result(error)

    def settle(self) -> None:
        if not self.settled.done():
            self.settled.set_result(None)
