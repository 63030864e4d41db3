"""Caps on what a client can hold open: event streams and long-polls.

Each open stream or long-poll holds a task and a socket for up to a minute; without a cap a
misbehaving client (or a storm of reconnects) could exhaust the agent's file descriptors and
memory, and with them its engines' supervision. Past the cap the answer is a 503 with
``Retry-After``, at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from runtime_agent.api.errors import BadRequest


class Slots:
    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what
        self.in_use = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.in_use >= self.limit:
            raise BadRequest(f"too many {self.what} open at once (the limit is {self.limit}); "
                             "try again shortly", 503, retry_after=5)
        self.in_use += 1
        try:
            yield
        finally:
            self.in_use -= 1
