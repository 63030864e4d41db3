"""An index of agents by free room per card, so a placement reads only the agents that can
hold the claim, not the whole fleet. Pure: plain dicts and sorted lists, no I/O, no clock.

``place`` (``placement``) reads every candidate of the claim's pool; at 1,000 Pods that was
~0.1 s of CPU per claim. ``RoomIndex`` files each candidate, once per change of it, under
``(namespace, GPU count, k, models awake)`` in a list sorted by the room of its k-th roomiest
GPU (descending), then name. A claim that needs ``k`` GPUs with ``R`` bytes each fits an agent
exactly when that agent's k-th roomiest GPU has ``R`` (an all-GPU claim: on an agent with
exactly ``k`` GPUs, whose k-th roomiest is its tightest). So the walk of one list stops at the
first entry under ``R``, and the first entry that also passes the claim's own checks (selector,
``unavailable``) is that list's best: the most room, then the name.

``best`` answers what ``place`` answers when some candidate fits, by the same order: an agent
that has served the artifact first (a small set, looked up by artifact), then the fewest models
awake (lists are walked level by level), then the most room, then the name. When nothing fits it
answers None and the caller asks ``place`` over every candidate for the reason (``TooLarge``,
the closest candidate); ``tests/test_room_index.py`` checks the two agree on random pools.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator

from reconciler.planning.placement import (
    DEFAULT_MAX_SNAPSHOT_AGE,
    ClaimNeed,
    Placed,
    choose_devices,
    unavailable,
)
from reconciler.planning.state import Candidate, artifact_id

# (namespace, GPU count, k, models awake) -> [(-room of the k-th roomiest GPU, name)], sorted
ListKey = tuple[str, int, int, int]
Row = tuple[int, str]


def kth_rooms(candidate: Candidate) -> list[int]:
    """Room of the agent's GPUs under its pool's policy, roomiest first: entry k-1 is the least
    room among the k roomiest GPUs, what a claim needing k of them would have on each."""
    return sorted((g.room(candidate.policy) for g in candidate.gpus), reverse=True)


class RoomIndex:
    """Candidates by free room per card; ``put`` a candidate whenever it changes."""

    def __init__(self) -> None:
        self._cands: dict[str, Candidate] = {}
        self._filed: dict[str, list[tuple[ListKey, Row]]] = {}
        self._lists: dict[ListKey, list[Row]] = {}
        self._levels: dict[tuple[str, int, int], set[int]] = {}  # awake counts with a list
        self._counts: dict[str, set[int]] = {}  # namespace -> GPU counts with a list
        self._served: dict[str, set[str]] = {}  # artifact id -> agents that have it

    def __len__(self) -> int:
        return len(self._cands)

    def __contains__(self, name: object) -> bool:
        return name in self._cands

    def __iter__(self) -> Iterator[str]:
        return iter(self._cands)

    def get(self, name: str) -> Candidate | None:
        return self._cands.get(name)

    def put(self, candidate: Candidate) -> None:
        """File ``candidate`` (replacing what was filed under its name)."""
        if self._cands.get(candidate.name) is candidate:
            return
        self.drop(candidate.name)
        name, ns, count = candidate.name, candidate.namespace, len(candidate.gpus)
        self._cands[name] = candidate
        filed = []
        awake = candidate.models_awake
        for k, room in enumerate(kth_rooms(candidate), start=1):
            key, row = (ns, count, k, awake), (-room, name)
            insort(self._lists.setdefault(key, []), row)
            self._levels.setdefault((ns, count, k), set()).add(awake)
            filed.append((key, row))
        if filed:
            self._counts.setdefault(ns, set()).add(count)
        self._filed[name] = filed
        for art in candidate.cached_artifacts:
            self._served.setdefault(artifact_id(art), set()).add(name)

    def drop(self, name: str) -> None:
        """Forget the agent (it left the pools)."""
        old = self._cands.pop(name, None)
        if old is None:
            return
        for key, row in self._filed.pop(name, ()):
            rows = self._lists[key]
            del rows[bisect_left(rows, row)]
            if not rows:
                del self._lists[key]
                ns, count, k, awake = key
                levels = self._levels[(ns, count, k)]
                levels.discard(awake)
                if not levels:
                    del self._levels[(ns, count, k)]
                    if k == 1:
                        self._counts[ns].discard(count)
                        if not self._counts[ns]:
                            del self._counts[ns]
        for art in old.cached_artifacts:
            holders = self._served.get(artifact_id(art))
            if holders is not None:
                holders.discard(name)
                if not holders:
                    del self._served[artifact_id(art)]

    def best(self, need: ClaimNeed, now: float, *,
             max_snapshot_age: float = DEFAULT_MAX_SNAPSHOT_AGE) -> Placed | None:
        """Where ``place`` would put the claim among the filed candidates, or None when none
        of them can hold it now (or the claim has no usable perGPU)."""
        room = need.room
        if room is None:
            return None
        served = self._served.get(artifact_id(need.artifact_url), set()) \
            if need.artifact_url else set()
        fits: list[tuple[tuple[int, int, str], Placed]] = []
        for name in served:
            got = self._fit(need, self._cands[name], room, now, max_snapshot_age)
            if got is not None:
                fits.append(((self._cands[name].models_awake, -got[1], name), got[0]))
        if fits:
            return min(fits, key=lambda f: f[0])[1]
        counts = self._counts.get(need.namespace, set())
        groups = [n for n in sorted(counts)
                  if (n == need.gpus if need.all_gpus else n >= need.gpus)]
        levels = sorted({a for n in groups
                         for a in self._levels.get((need.namespace, n, need.gpus), ())})
        for awake in levels:
            best: tuple[Row, Placed] | None = None
            for n in groups:
                found = self._first(need, self._lists.get((need.namespace, n, need.gpus, awake),
                                                          ()), served, room, now,
                                    max_snapshot_age)
                if found is not None and (best is None or found[0] < best[0]):
                    best = found
            if best is not None:
                return best[1]
        return None

    def _first(self, need: ClaimNeed, rows: Iterable[Row], served: set[str], room: int,
               now: float, max_age: float) -> tuple[Row, Placed] | None:
        """The first row of a list whose agent takes the claim: the list's best."""
        for row in rows:
            if -row[0] < room:
                return None
            if row[1] in served:
                continue  # looked at first, and it could not take the claim
            got = self._fit(need, self._cands[row[1]], room, now, max_age)
            if got is not None:
                return row, got[0]
        return None

    @staticmethod
    def _fit(need: ClaimNeed, cand: Candidate, room: int, now: float,
             max_age: float) -> tuple[Placed, int] | None:
        if cand.namespace != need.namespace or not need.selector.matches(cand.labels):
            return None
        if unavailable(need, cand, now, max_age) is not None:
            return None
        devices, least, _ = choose_devices(need, cand)
        if least < room:
            return None
        return Placed(cand.name, devices, least - room), least
