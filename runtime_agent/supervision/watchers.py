"""What an engine owner's helper tasks watch: each observes the engine and posts what it saw.

They decide nothing and change nothing: every finding goes to the owner's inbox as a message
tagged with the process generation it was about, and the owner (``runtime_agent.supervision.owner``) acts
on it with its own, current state, or drops it when that process is gone.

* ``probe_ready``: probe until the engine answers (its answer says whether it sleeps), prepare
  it (Ollama loads its model, then is asked again) -> ``Ready`` or ``Unusable``.
* ``watch_progress``: a booting engine that neither answers nor logs for ``start_stall_s`` is
  stuck -> ``Unusable``.
* ``scrape``: request figures -> ``Figures``, paced (``runtime_agent.cadence``): every
  ``scrape_interval_s`` while they change, backing off while they do not.
* ``watch_health``: once ready, a probe -> ``Health`` (answered, the engine's word on sleep,
  misses in a row), paced: every ``health_interval_s`` after any change or miss, backing off
  while the answers stay the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from contract.clock import Clock
from engines.driver import EngineDriver
from engines.client import EngineCallError
from runtime_agent.cadence import Pacer
from runtime_agent.settings import Settings
from runtime_agent.supervision.backoff import probe_delays
from runtime_agent.supervision.messages import Figures, Health, Message, Ready, Unusable

Post = Callable[[Message], None]


async def probe_ready(driver: EngineDriver, settings: Settings, post: Post, gen: int,
                      prepare: bool, clock: Clock, asleep: bool = False) -> None:
    """Probe until the engine answers; a started engine is then prepared unless it is meant
    to sleep; then its own word on sleep decides.

    The probe is the health watcher's own (``driver.probe``): one request that carries the
    engine's word on sleep where it has one (vLLM's ``/is_sleeping``), so a fresh engine is
    ready on its first answer instead of a second round trip. Preparing may change that word
    (Ollama loads its model): an engine whose preparing did something is asked again."""
    s = settings
    sleeping: bool | None = None
    for delay in probe_delays(s.probe_first_s, s.probe_factor, s.probe_max_s):
        await clock.sleep(delay)
        answered, sleeping = await driver.probe(s.probe_timeout_s, asleep)
        if answered:
            break
    if prepare:
        try:
            changed = await driver.prepare(s.lifecycle_timeout_s)
        except EngineCallError as exc:
            post(Unusable(gen, f"start-up failed: {exc}"))
            return
        if changed:
            sleeping = await driver.is_sleeping(s.probe_timeout_s)
    post(Ready(gen, sleeping))


async def watch_progress(log_path: Path, settings: Settings, post: Post, gen: int,
                         ready: Callable[[], bool], clock: Clock) -> None:
    """Until ``ready()``, watch the engine's log grow; report it stuck when it stops."""
    stall = settings.start_stall_s
    last_size, last_change = -1, clock.now()
    while not ready():
        try:
            size = (await asyncio.to_thread(log_path.stat)).st_size
        except OSError:
            size = -1
        now = clock.now()
        if size != last_size:
            last_size, last_change = size, now
        elif now - last_change >= stall:
            post(Unusable(gen, f"start-up made no progress (no port, no log output) for "
                           f"{stall:g} s"))
            return
        await clock.sleep(min(1.0, stall / 4))


async def scrape(driver: EngineDriver, settings: Settings, post: Post, gen: int,
                 pacer: Pacer) -> None:
    """Read the engine's request figures now, then as ``pacer`` says: figures other than the
    last ones (requests came or went) are an event."""
    last: object = None
    while True:
        figures = await driver.observe(settings.probe_timeout_s)
        if figures is not None:
            post(Figures(gen, figures))
        pacer.looked(event=figures != last)
        last = figures
        await pacer.pause()


async def watch_health(driver: EngineDriver, settings: Settings, post: Post, gen: int,
                       asleep: Callable[[], bool], busy: Callable[[], bool],
                       pacer: Pacer) -> None:
    """Probe a ready engine as ``pacer`` says: its answer (or none within the probe timeout)
    and its word on sleep -> ``Health``, with the count of misses in a row. A miss, or an
    answer other than the last, is an event: the next probe comes after the floor interval,
    so misses in a row are counted at the fast pace. While a sleep or wake runs (``busy``),
    the engine's core may take its time over it, so only its server's liveness is probed (its
    own health endpoint)."""
    misses = 0
    last: tuple[bool, bool | None] | None = None
    while True:
        await pacer.pause()
        if busy():
            answered = await driver.healthy(settings.probe_timeout_s, asleep())
            sleeping: bool | None = None
        else:
            answered, sleeping = await driver.probe(settings.probe_timeout_s, asleep())
        misses = 0 if answered else misses + 1
        post(Health(gen, answered, sleeping, misses))
        pacer.looked(event=not answered or (answered, sleeping) != last)
        last = (answered, sleeping)
