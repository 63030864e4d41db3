"""Stopping a background task: cancel it and wait until it has finished, so whoever stops a
part knows that nothing of it runs afterwards (a cancel alone returns while the task still
unwinds its ``finally`` blocks)."""

from __future__ import annotations

import asyncio


async def cancelled(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (None: nothing to stop) and return once it has finished."""
    if task is not None:
        task.cancel()
        await asyncio.wait([task])
