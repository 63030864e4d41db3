"""Copies by demand (issue 25, item 2): how many engines a claim with a range runs now. Pure.

A claim whose ``spec.maxReplicas`` is above its ``spec.replicas`` runs at least ``replicas``
engines (its minimum) and at most ``maxReplicas``. ``next_count`` makes one step from the
count it runs now:

* **One more** when the door's queue for the claim has cost more than loading a copy for
  ``UP_AFTER_S`` without a break: the queue is the seed's wait (the soonest a new call could
  start on one of the claim's serving replicas: what is left of its soonest call plus one
  latency per call beyond its slots, spread across them; ``selection.delay.queue_wait``), the
  load is the copy's bring-up (its footprint at 1 GiB/s, the seed's figure), the same cost
  model as a route's queue-or-unload. Only while every replica serves (one copy comes up at a
  time: a queue that a copy on its way will relieve is not counted twice) and only where a copy
  fits now (``room``: an agent that runs none of its replicas has the room free; a copy never
  puts another model to sleep).
* **One less** when the highest copy above the minimum has had no request (running, waiting,
  in flight through the door or held for it) for ``down_after_s``: by default twice its
  ``sleepAfterSeconds`` (the claim's own, else its pool's), so an idle copy is first put to
  sleep by the idle rule and stopped after as long again asleep; ``DOWN_WITHOUT_SLEEP_S``
  when its policy does not sleep idle models. The reconciler then drains it (off the route,
  requests finish, engine stopped), as for any replica scaled down.

The count never leaves ``[minimum, maximum]``; a count outside it (the range was edited) is
brought inside at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

UP_AFTER_S = 2.0  # the queue must cost more than a load this long before a copy is added
DOWN_WITHOUT_SLEEP_S = 600.0  # idle time before an extra copy stops, where idle models stay up
SCALED_UP, SCALED_DOWN = "ScaledUp", "ScaledDown"


@dataclass(frozen=True)
class Replica:
    """One replica as the scaler reads it: ``serving`` (Active, on the route), ``idle_s``
    (seconds without a request; None: busy now, or not known)."""

    index: int
    serving: bool
    idle_s: float | None = None


@dataclass(frozen=True)
class Step:
    """The count to run; ``reason`` (``ScaledUp``, ``ScaledDown``; "" when unchanged) and a
    message that says why, with the figures."""

    count: int
    reason: str = ""
    message: str = ""


def down_after(sleep_after_s: float) -> float:
    """Idle time before an extra copy is removed, from its sleep policy's idle time (0: it
    does not sleep idle models)."""
    return 2 * sleep_after_s if sleep_after_s > 0 else DOWN_WITHOUT_SLEEP_S


def next_count(minimum: int, maximum: int, replicas: Sequence[Replica], queue_s: float | None,
               load_s: float, over_for_s: float, room: bool, down_after_s: float) -> Step:
    """The next count for a claim running ``len(replicas)`` copies (see the module's
    docstring). ``over_for_s``: how long the queue has cost more than ``load_s`` without a
    break (0: it does not now)."""
    count = len(replicas)
    if count < minimum or count > maximum:
        target = min(max(count, minimum), maximum)
        return Step(target, SCALED_UP if target > count else SCALED_DOWN,
                    f"brought into its range {minimum}..{maximum}")
    if count < maximum and over_for_s >= UP_AFTER_S and room and queue_s is not None \
            and all(r.serving for r in replicas):
        return Step(count + 1, SCALED_UP, (
            f"the queue at its {count} cop{'y' if count == 1 else 'ies'} costs {queue_s:.1f} s, "
            f"more than loading another ({load_s:.1f} s), for {over_for_s:.0f} s"))
    if count > minimum:
        last = max(replicas, key=lambda r: r.index)
        if last.idle_s is not None and last.idle_s >= down_after_s:
            return Step(count - 1, SCALED_DOWN, (
                f"copy {last.index} had no request for {last.idle_s:.0f} s "
                f"(at least {down_after_s:g} s)"))
    return Step(count)


def queue_costs_more(queue_s: float | None, load_s: float) -> bool:
    """The queue is longer than a load (no queue: no serving copy, nothing to weigh)."""
    return queue_s is not None and queue_s > load_s
