"""A claim's own sleep policy: the ``claim.model.aibrix.ai/lifecycle`` annotation (our addition).

The guide's sleep policy is per pool ("A model that must stay awake needs a pool without idle
sleep"). A claim may override its pool's for itself, in the pool policy's own words and style:

    claim.model.aibrix.ai/lifecycle: '{"sleepAfterSeconds": 600}'
    claim.model.aibrix.ai/lifecycle: '{"neverSleep": true}'
    claim.model.aibrix.ai/lifecycle: '{"sleepAfterSeconds": 120, "sleepToMakeRoomAfterSeconds": 10}'

* ``sleepAfterSeconds``: this claim's idle time before it is put to sleep (positive; the pool's
  rule on 0 belongs to the pool: a claim that must not idle-sleep says ``neverSleep``).
* ``neverSleep`` (false): never put to sleep for being idle, and never chosen as a victim to
  make room for another model. A release at the front door (the gateway's explicit ask) still
  sleeps it. Not together with the other two fields.
* ``sleepToMakeRoomAfterSeconds``: idle time before this claim's engine may be put to sleep to
  make room (positive, no longer than its ``sleepAfterSeconds`` when both are given). It counts
  only in pools with ``noWakeReserveWhileAsleep``, the only ones that sleep models for room.

Fields not written keep the pool's value. An annotation that is not valid JSON, has an unknown
field or an invalid value is ignored as a whole: the claim runs under its pool's policy and its
status says why (the ``LifecycleApplied`` condition, reason ``InvalidLifecycle``), as an invalid
pool policy is reported and turned off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from reconciler.model.policy import PolicyError, PoolPolicy, decode_json, no_unknown

LIFECYCLE_ANNOTATION = "claim.model.aibrix.ai/lifecycle"
INVALID_LIFECYCLE = "InvalidLifecycle"
_FIELDS = frozenset({"sleepAfterSeconds", "sleepToMakeRoomAfterSeconds", "neverSleep"})
NEVER = math.inf


@dataclass(frozen=True)
class ClaimLifecycle:
    """What a claim overrides; None: the pool's value."""

    sleep_after_seconds: float | None = None
    sleep_to_make_room_after_seconds: float | None = None
    never_sleep: bool = False

    def applied_to(self, pool: PoolPolicy) -> PoolPolicy:
        """The policy the claim's engine lives under in ``pool``."""
        if self.never_sleep:
            return replace(pool, sleep_after_seconds=0.0, sleep_to_make_room_after_seconds=NEVER)
        out = pool
        if self.sleep_after_seconds is not None:  # the pool's rule: room no later than idle
            out = replace(out, sleep_after_seconds=self.sleep_after_seconds,
                          sleep_to_make_room_after_seconds=min(
                              pool.sleep_to_make_room_after_seconds, self.sleep_after_seconds))
        if self.sleep_to_make_room_after_seconds is not None:
            out = replace(out, sleep_to_make_room_after_seconds=self.sleep_to_make_room_after_seconds)
        return out

    @property
    def make_room_after(self) -> float | None:
        """This claim's idle time before it may be slept for room (None: the pool's)."""
        return NEVER if self.never_sleep else self.sleep_to_make_room_after_seconds


class LifecycleError(PolicyError):
    pass


def lifecycle_of(annotations: object) -> tuple[ClaimLifecycle | None, str | None]:
    """(override, None) from a claim's annotations (None: no override); (None, why) when the
    annotation is invalid."""
    raw = annotations.get(LIFECYCLE_ANNOTATION) if isinstance(annotations, Mapping) else None
    if raw is None:
        return None, None
    try:
        return _parse(raw), None
    except PolicyError as exc:
        return None, f"{LIFECYCLE_ANNOTATION} ignored, the pool's policy applies: {exc}"


def _parse(raw: object) -> ClaimLifecycle | None:
    if not isinstance(raw, str):
        raise LifecycleError("the annotation must be a JSON text such as "
                             '\'{"sleepAfterSeconds": 600}\'')
    if not raw.strip():
        return None
    doc = decode_json(raw, "the annotation")
    if not isinstance(doc, Mapping):
        raise LifecycleError('it must be a JSON object such as {"sleepAfterSeconds": 600} or '
                             '{"neverSleep": true}')
    no_unknown(doc, _FIELDS, "the annotation")
    never = doc.get("neverSleep", False)
    if not isinstance(never, bool):
        raise LifecycleError(f"neverSleep must be true or false, got {never!r}")
    after = _positive(doc, "sleepAfterSeconds")
    make_room = _positive(doc, "sleepToMakeRoomAfterSeconds")
    if never and (after is not None or make_room is not None):
        raise LifecycleError("neverSleep: true cannot be given with sleepAfterSeconds or "
                             "sleepToMakeRoomAfterSeconds")
    if after is not None and make_room is not None and make_room > after:
        raise LifecycleError(f"sleepToMakeRoomAfterSeconds ({make_room:g}) must be no longer "
                             f"than sleepAfterSeconds ({after:g})")
    return ClaimLifecycle(after, make_room, never)


def _positive(doc: Mapping[str, object], name: str) -> float | None:
    if name not in doc:
        return None
    value = doc[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LifecycleError(f"{name} must be a number of seconds, got {value!r}")
    if value <= 0:
        raise LifecycleError(f"{name} must be positive, got {value:g}"
                             + ("; to keep the model awake write {\"neverSleep\": true}"
                                if name == "sleepAfterSeconds" else ""))
    return float(value)
