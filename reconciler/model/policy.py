"""A pool's sleep policy: the ``claim.model.aibrix.ai/pool-policy`` JSON, validated per the guide.

    {"lifecycle": {"sleepAfterSeconds": 300, "noWakeReserveWhileAsleep": true,
                   "sleepToMakeRoomAfterSeconds": 30},
     "artifacts": {"preStage": true}}

* ``sleepAfterSeconds``: idle time before a model is put to sleep. Absent or 0 keeps models
  awake unless room is needed, which is allowed only with ``noWakeReserveWhileAsleep``.
* ``noWakeReserveWhileAsleep`` (false): a sleeping model reserves only what it still holds.
* ``sleepToMakeRoomAfterSeconds``: only with ``noWakeReserveWhileAsleep``; positive; defaults to
  30, or to ``sleepAfterSeconds`` when that is set and shorter; no longer than
  ``sleepAfterSeconds`` when that is set (to a positive value).
* ``reclaim``: deprecated, accepted and ignored (it must be an object).
* ``artifacts.preStage`` (false; this project's addition): ask the pool's agents to stage the
  artifacts of claims that are declared but not placed yet into their weight caches, so the
  first start reads local disk (a warm pool warms its disks too).

A policy with an unknown field or an invalid value is turned off (``POLICY_OFF``) and the reason
is returned, for an ``InvalidPoolPolicy`` problem. No annotation, an empty one, or a policy with
no ``lifecycle`` section (``{}``, or only ``reclaim``) is simply off, with no problem: the rule on
``sleepAfterSeconds`` applies to a ``lifecycle`` section that is written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

POLICY_ANNOTATION = "claim.model.aibrix.ai/pool-policy"
INVALID_POOL_POLICY = "InvalidPoolPolicy"
DEFAULT_SLEEP_TO_MAKE_ROOM_S = 30.0
_TOP_FIELDS = frozenset({"lifecycle", "reclaim", "artifacts"})
_ARTIFACT_FIELDS = frozenset({"preStage"})
_LIFECYCLE_FIELDS = frozenset(
    {"sleepAfterSeconds", "noWakeReserveWhileAsleep", "sleepToMakeRoomAfterSeconds"})


@dataclass(frozen=True)
class PoolPolicy:
    """The effective policy. ``sleep_after_seconds`` 0: no idle sleep."""

    sleep_after_seconds: float = 0.0
    no_wake_reserve_while_asleep: bool = False
    sleep_to_make_room_after_seconds: float = DEFAULT_SLEEP_TO_MAKE_ROOM_S
    pre_stage: bool = False  # stage unplaced claims' artifacts on the pool's agents

    @property
    def idle_sleep(self) -> bool:
        return self.sleep_after_seconds > 0


POLICY_OFF = PoolPolicy()


class PolicyError(ValueError):
    pass


def parse_pool_policy(raw: object) -> tuple[PoolPolicy, str | None]:
    """(policy, None) when valid; (``POLICY_OFF``, why) when not. ``raw``: JSON text or an
    already-decoded object (a WarmPool manifest may write it as YAML); None or "" is no policy."""
    try:
        return _parse(raw), None
    except PolicyError as exc:
        return POLICY_OFF, str(exc)


def _reject_constant(name: str) -> object:
    raise PolicyError(f"{name} is not a valid JSON number")


def decode_json(text: str, what: str) -> object:
    """An annotation's JSON text, NaN and Infinity refused; ``PolicyError`` saying why."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise PolicyError(f"{what} is not valid JSON: {exc}") from None


def _parse(raw: object) -> PoolPolicy:
    if raw is None:
        return POLICY_OFF
    if isinstance(raw, str):
        if not raw.strip():
            return POLICY_OFF
        raw = decode_json(raw, "the policy")
    if not isinstance(raw, Mapping):
        raise PolicyError("the policy must be a JSON object such as "
                          '{"lifecycle": {"sleepAfterSeconds": 300}}')
    no_unknown(raw, _TOP_FIELDS, "the policy")
    if "reclaim" in raw and not isinstance(raw["reclaim"], Mapping):
        raise PolicyError("reclaim (deprecated, ignored) must be an object")
    pre_stage = _pre_stage(raw.get("artifacts", {}))
    if "lifecycle" not in raw:
        return replace(POLICY_OFF, pre_stage=pre_stage)
    return replace(_lifecycle(raw), pre_stage=pre_stage)


def _pre_stage(section: object) -> bool:
    if not isinstance(section, Mapping):
        raise PolicyError("artifacts must be an object such as {\"preStage\": true}")
    no_unknown(section, _ARTIFACT_FIELDS, "artifacts")
    value = section.get("preStage", False)
    if not isinstance(value, bool):
        raise PolicyError(f"artifacts.preStage must be true or false, got {value!r}")
    return value


def _lifecycle(raw: Mapping[object, object]) -> PoolPolicy:
    life = raw["lifecycle"]
    if not isinstance(life, Mapping):
        raise PolicyError("lifecycle must be an object")
    no_unknown(life, _LIFECYCLE_FIELDS, "lifecycle")
    no_reserve = life.get("noWakeReserveWhileAsleep", False)
    if not isinstance(no_reserve, bool):
        raise PolicyError(f"lifecycle.noWakeReserveWhileAsleep must be true or false, "
                          f"got {no_reserve!r}")
    after = _seconds(life, "sleepAfterSeconds")
    if (after is None or after == 0) and not no_reserve:
        raise PolicyError(
            "lifecycle.sleepAfterSeconds must be positive; leaving it out or setting it to 0 "
            "(keep models awake unless room is needed) is allowed only with "
            "noWakeReserveWhileAsleep")
    make_room = _seconds(life, "sleepToMakeRoomAfterSeconds")
    if make_room is not None:
        if not no_reserve:
            raise PolicyError("lifecycle.sleepToMakeRoomAfterSeconds is used only with "
                              "noWakeReserveWhileAsleep: true")
        if make_room <= 0:
            raise PolicyError(f"lifecycle.sleepToMakeRoomAfterSeconds must be positive, "
                              f"got {make_room:g}")
        if after and make_room > after:
            raise PolicyError(
                f"lifecycle.sleepToMakeRoomAfterSeconds ({make_room:g}) must be no longer than "
                f"sleepAfterSeconds ({after:g})")
    else:
        make_room = min(DEFAULT_SLEEP_TO_MAKE_ROOM_S, after) if after else \
            DEFAULT_SLEEP_TO_MAKE_ROOM_S
    return PoolPolicy(sleep_after_seconds=float(after or 0.0),
                      no_wake_reserve_while_asleep=no_reserve,
                      sleep_to_make_room_after_seconds=float(make_room))


def no_unknown(obj: Mapping[object, object], known: frozenset[str], where: str) -> None:
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        raise PolicyError(f"{where} has unknown field{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(unknown)}; known: {', '.join(sorted(known))}")


def _seconds(life: Mapping[object, object], name: str) -> float | None:
    if name not in life:
        return None
    value = life[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PolicyError(f"lifecycle.{name} must be a number of seconds, got {value!r}")
    if value < 0:
        raise PolicyError(f"lifecycle.{name} must not be negative, got {value:g}")
    return float(value)
