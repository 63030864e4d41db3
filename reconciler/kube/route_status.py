"""ModelRoute statuses on Kubernetes: what the door chooses among, where ``kubectl`` shows it.

After the routes or the claims change (one pass per ``interval`` however many changes came),
every ModelRoute object gets the status the reconciler's ``GET /v1/modelroutes`` shows for it
(``reconciler.door.routing.describe_routes``, one function for both), as the CRD declares it:

* a route taken: its candidates in order (``claim``, ``model``, ``score``), ``candidateCount``
  and ``preferred`` (the printer columns), ``Accepted`` True, and ``FailedScheduling``: True
  (``NoMatchingModel``, naming the selector that matched nothing) while its require admits no
  claim, False (``Matched``) otherwise;
* a route refused (``InvalidRoute``, ``Duplicate``: ``reconciler.kube.route_objects``): no
  candidates, ``Accepted`` False with the problem's reason and message; the door serves it not.

A condition keeps its ``lastTransitionTime`` while its status stays. A status is written (a
merge patch of the ``/status`` subresource) only when it differs from what the object shows, or
from what we wrote on the version the informer still holds (our write, not yet seen by the
watch, is not written twice). Each write that turns ``FailedScheduling`` True, or refuses the
route, also raises a Warning Event (``on_warning``: ``reconciler.kube.events``), once per turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from contract.clock import Clock
from reconciler.door.routing import FAILED_SCHEDULING, describe_routes
from reconciler.kube.api import MERGE_PATCH, ROUTES, KubeApi, KubeError, NotFound, Obj
from reconciler.kube.desired import KubeDesired
from reconciler.kube.events import stamp
from reconciler.kube.informer import ObjKey, meta, resource_version
from reconciler.model.manifests import Problem
from reconciler.runtime.tasks import cancelled

log = logging.getLogger("reconciler.kube.route_status")

ACCEPTED = "Accepted"
Status = dict[str, Any]


def route_status(described: Mapping[str, Any] | None, problem: Problem | None,
                 generation: int | None, shown: Mapping[str, Any] | None, wall: float
                 ) -> Status:
    """The status of one route object: ``described`` when it was taken, else ``problem``
    (why not); ``shown`` is the status it has now (whose transition times are kept)."""
    if described is not None:
        candidates = list(described["candidates"])
        conditions = [{"type": ACCEPTED, "status": "True", "reason": ACCEPTED,
                       "message": "the door serves this route"},
                      *(dict(c) for c in described["conditions"])]
    else:
        candidates = []
        conditions = [{"type": ACCEPTED, "status": "False",
                       "reason": problem.reason if problem else "Unknown",
                       "message": problem.message if problem else ""}]
    before = {c.get("type"): c for c in (shown or {}).get("conditions") or ()}
    for cond in conditions:
        was = before.get(cond["type"])
        kept = was is not None and was.get("status") == cond["status"]
        cond["lastTransitionTime"] = was.get("lastTransitionTime") if kept and was else \
            stamp(wall)
        if generation is not None:
            cond["observedGeneration"] = generation
    status: Status = {"candidates": candidates, "candidateCount": len(candidates),
                      "conditions": conditions}
    if candidates:
        status["preferred"] = candidates[0]["model"]
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def warnings(shown: Mapping[str, Any] | None, status: Mapping[str, Any]
             ) -> list[tuple[str, str]]:
    """The Warning Events (reason, message) a change from ``shown`` to ``status`` raises."""
    def cond(doc: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any]:
        return next((c for c in (doc or {}).get("conditions") or () if c.get("type") == type_),
                    {})
    out = []
    accepted, was = cond(status, ACCEPTED), cond(shown, ACCEPTED)
    if accepted.get("status") == "False" and (was.get("status"), was.get("reason")) != (
            "False", accepted.get("reason")):
        out.append((str(accepted["reason"]), str(accepted.get("message", ""))))
    failed = cond(status, FAILED_SCHEDULING)
    if failed.get("status") == "True" and cond(shown, FAILED_SCHEDULING).get("status") != "True":
        out.append((FAILED_SCHEDULING, str(failed.get("message", ""))))
    return out


class RouteStatusWriter:
    """Writes every ModelRoute's status after a change (``mark``), on one task."""

    def __init__(self, api: KubeApi, desired: KubeDesired, clock: Clock,
                 on_warning: Callable[[Obj, str, str], None], interval: float = 0.5) -> None:
        self.api = api
        self.desired = desired
        self.clock = clock
        self.on_warning = on_warning
        self.interval = interval
        self.writes = 0
        self.passes = 0
        self._due = asyncio.Event()
        self._sent: dict[ObjKey, tuple[str, Status]] = {}  # key: (version written on, status)
        self._task: asyncio.Task[None] | None = None

    def mark(self) -> None:
        """The routes or the claims changed: write the statuses again soon."""
        self._due.set()

    def start(self) -> None:
        self._due.set()  # the statuses as this replica sees them, once it leads
        self._task = asyncio.get_running_loop().create_task(self._run(), name="route-status")

    async def stop(self) -> None:
        """Stop writing (a pass half done is done by the next leader: statuses are levels)."""
        task, self._task = self._task, None
        await cancelled(task)

    async def _run(self) -> None:
        while True:
            await self._due.wait()
            self._due.clear()
            try:
                await self.write_all()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("writing the ModelRoute statuses failed; trying again")
                self._due.set()
            await self.clock.sleep(self.interval)

    async def write_all(self) -> None:
        self.passes += 1
        objects = self.desired.route_objects.objects
        for gone in self._sent.keys() - objects.keys():
            del self._sent[gone]
        if not objects:
            return  # no routes: no claim is read (a fleet's claim changes cost nothing here)
        described = describe_routes(self.desired)
        problems = {(p.namespace or "default", p.name): p for p in self.desired.route_problems}
        for key, obj in sorted(objects.items()):
            route = self.desired.routes.get(key[1])
            taken = described.get(key[1]) if route is not None and route.namespace == key[0] \
                else None
            if taken is None and key not in problems:
                continue  # not taken yet: a take is due, and marks us again
            await self._write(key, obj, taken, problems.get(key))

    async def _write(self, key: ObjKey, obj: Obj, taken: Mapping[str, Any] | None,
                     problem: Problem | None) -> None:
        version = resource_version(obj)
        sent = self._sent.get(key)
        shown = sent[1] if sent is not None and sent[0] == version else obj.get("status")
        generation = meta(obj).get("generation")
        status = route_status(taken, problem, generation if isinstance(generation, int)
                              else None, shown, self.clock.wall())
        if status == shown:
            return
        gone = {k: None for k in {**(obj.get("status") or {}), **(shown or {})}
                if k not in status}  # a merge patch keeps what it does not name
        try:
            await self.api.patch(ROUTES, key[0], key[1], {"status": {**gone, **status}},
                                 MERGE_PATCH, subresource="status")
        except NotFound:
            return  # deleted meanwhile: the informer says so next
        except (KubeError, OSError, asyncio.TimeoutError) as err:
            log.warning("modelroute %s/%s: status not written (%s); trying again", *key, err)
            self._due.set()
            return
        self._sent[key] = (version, status)
        self.writes += 1
        for reason, message in warnings(shown, status):
            self.on_warning(obj, reason, message)
