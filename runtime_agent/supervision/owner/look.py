"""A look at the engine's request figures asked for now, shared by every caller who waits for one.

The scrape loop backs off to ``--scrape-interval-max`` while nothing changes, so its figures may
be that old. A caller whose decision must not rest on an old figure (an idle sleep's last look:
the snapshot route with ``?fresh=requests``) asks the owner for a look that *starts after* it
asked. Two rules keep that cheap and honest:

- a look already running began before the caller asked, so the caller never takes its answer:
  it waits for the next look, which starts when the running one ends;
- every caller who arrives while a look runs shares that one next look, so one engine call is
  in flight per engine and one more waits, however many callers come (a reader cannot turn
  fresh snapshots into a scrape storm).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engines.driver import EngineDriver, Observation
from runtime_agent.supervision.messages import Figures, Message


class FreshLook:
    """``await look(serving)``: figures read by an engine call that started after this call did,
    or None: the engine did not answer (within ``timeout_s``), gave no request figures, or was
    not ``serving()`` in the same process before and after."""

    def __init__(self, engine: EngineDriver, timeout_s: float, post: Callable[[Message], None],
                 generation: Callable[[], int]) -> None:
        self._engine, self._timeout_s, self._post, self._gen = engine, timeout_s, post, generation
        self._flight: asyncio.Task[Observation | None] | None = None  # the look in progress
        self._queued: asyncio.Future[Observation | None] | None = None  # the next one's answer

    async def __call__(self, serving: Callable[[], bool]) -> Observation | None:
        gen = self._gen()
        if not serving():
            return None
        figures = await self._shared()
        if figures is None or figures.running is None or self._gen() != gen or not serving():
            return None
        return figures

    async def _shared(self) -> Observation | None:
        if self._flight is None:
            self._flight = asyncio.create_task(self._fly())
            return await asyncio.shield(self._flight)
        if self._queued is None:
            self._queued = asyncio.get_running_loop().create_future()
        return await asyncio.shield(self._queued)

    async def _fly(self) -> Observation | None:
        """One engine call; its figures go to the owner like a scrape's (a change brings the
        watchers' fast pace back)."""
        try:
            gen = self._gen()
            figures = await self._engine.observe(self._timeout_s)
            if figures is not None:
                self._post(Figures(gen, figures))
            return figures
        finally:  # the callers who came meanwhile get the next look, begun now
            self._flight, queued, self._queued = None, self._queued, None
            if queued is not None:
                self._flight = asyncio.create_task(self._fly())
                self._flight.add_done_callback(lambda task: _copy(task, queued))

    def cancel(self) -> None:
        """The owner ends: no look is left running; its waiters are cancelled."""
        if self._flight is not None:
            self._flight.cancel()
        if self._queued is not None:
            self._queued.cancel()


def _copy(task: asyncio.Task[Observation | None], into: asyncio.Future[Observation | None]
          ) -> None:
    if into.done():
        return
    if task.cancelled():
        into.cancel()
    elif (exc := task.exception()) is not None:
        into.set_exception(exc)
    else:
        into.set_result(task.result())
