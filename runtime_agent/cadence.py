"""How often a running engine is asked about itself: fast after any change, slower while none.

With 64 engines, probing each every second and scraping each every two was most of the agent's
idle CPU (12.5% of a core, ``bench.bench_idle``), for answers that did not change. The kernel
already says at once when an engine exits (its pidfd, ``engines.process``): a probe is there to
find an engine that lives but no longer answers, and a scrape to see its requests come and go.
So a watcher asks at its floor interval after anything happened and doubles the interval on
every look that found nothing new, up to its cap:

- *an event* resets it to the floor: a look that failed or saw something new (a missed probe,
  other request figures), and, through ``Pacer.nudge``, anything the owner saw (a transition, an
  intent from the API such as a KV limit, a KV segment that changed, a request seen);
- a nudge during a long wait brings the next look within one floor interval of it, never later
  than the wait already planned, and never more than one look per floor however often it comes
  (an API caller cannot turn nudges into a probe storm).

``next_interval`` is the rule, a pure function; ``Pacer`` is its thin async side for one
watcher loop, waiting on the owner's injected clock (``contract.clock``). What the cap costs in detection is written in the README (``--health-interval``).
"""

from __future__ import annotations

import asyncio

from msgspec import Struct

from contract.clock import Clock
from runtime_agent.loops import wait_event


class Cadence(Struct, frozen=True):
    """A watcher's intervals: ``floor_s`` after an event, times ``factor`` per quiet look, at
    most ``cap_s``."""

    floor_s: float
    cap_s: float
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not (self.floor_s > 0 and self.cap_s >= self.floor_s and self.factor >= 1):
            raise ValueError(f"need 0 < floor <= cap and factor >= 1, got floor {self.floor_s}, "
                             f"cap {self.cap_s}, factor {self.factor}")


def next_interval(cadence: Cadence, previous_s: float | None, event: bool) -> float:
    """The wait before the next look. ``event``: the last look failed or found something new,
    or the owner saw a change since; then the floor. Otherwise the previous wait grown by the
    factor, kept within floor and cap. ``previous_s`` None: the first look, at the floor."""
    if event or previous_s is None:
        return cadence.floor_s
    return min(cadence.cap_s, max(cadence.floor_s, previous_s * cadence.factor))


class Pacer:
    """One watcher loop's clock: ``await pause()`` between looks, ``looked(event)`` after each;
    ``nudge()`` from the owner when something changed. It waits on ``clock``."""

    def __init__(self, cadence: Cadence, clock: Clock) -> None:
        self.cadence = cadence
        self.clock = clock
        self.interval_s = cadence.floor_s
        self._nudged = asyncio.Event()

    def nudge(self) -> None:
        self._nudged.set()

    async def pause(self) -> None:
        """Wait the current interval. Nudged during its first part, wait one floor from then
        (the last floor is always waited whole: at most one look per floor)."""
        floor = self.cadence.floor_s
        if self.interval_s > floor:
            await wait_event(self._nudged, self.interval_s - floor, self.clock)
        await self.clock.sleep(floor)

    def looked(self, event: bool) -> None:
        """After a look: the next interval, by the rule, counting a nudge since the last look
        as an event."""
        event = event or self._nudged.is_set()
        self._nudged.clear()
        self.interval_s = next_interval(self.cadence, self.interval_s, event)
