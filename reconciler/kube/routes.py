"""Routes and wake requests as Pod annotations: what the gateway reads and what it asks for.

A claim's route is ``route.claim.model.aibrix.ai/<claim>`` on the Pod of its engine, as JSON
``{"model", "port", "state", "wakeByRequest"}`` (and ``reason`` while it waits), computed by the
one ``route_of`` the HTTP route table uses. ``RoutePublisher`` keeps the annotations equal to
it: a claim whose status changed is marked, and the next round patches only the Pods whose
annotation differs, with a JSON merge patch of just those keys (``null`` removes one); a claim
that moved loses its annotation on the old Pod, a claim being deleted loses it first (off the
route before its engine drains). ``sync_model`` publishes one model's route at once and answers
whether it is out, which a sleep waits for (off the route before a sleep). A claim with
several replicas (``reconciler.replicas``) has the same annotation on each replica's Pod, each
with that replica's port and state, so the gateway finds every copy by the seed's key.

The gateway asks for a wake with ``wake.modelclaim.aibrix.ai/<claim>`` (the request time). A
new value becomes a request in the ``WakeBook`` and the claim is reconciled; once the book no
longer holds it (the model serves, the wake failed, or it expired after five minutes) the
annotation is removed with a JSON patch that first tests its value, so a newer request written
meanwhile is kept. A claim that already serves has its request removed at once. With several
replicas, "serves" is any replica, and the request wakes one replica, not each: the lowest that
sleeps (replica 0 when none does), by its route name (``reconciler.replicas.route_name``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from contract.clock import Clock
from reconciler.context import Deps
from reconciler.desired import ClaimKey, key_text
from reconciler.kube.api import (
    JSON_PATCH,
    MERGE_PATCH,
    PODS,
    Conflict,
    KubeApi,
    KubeError,
)
from reconciler.kube.desired import (
    ROUTE_PREFIX,
    WAKE_PREFIX,
    KubeDesired,
    PodAgent,
    pod_of,
)
from reconciler.replicas import base_key, model_of_route, route_name
from reconciler.routes import Route, route_of
from reconciler.runtime.tasks import cancelled
from reconciler.status import ACTIVE, SLEEPING, ClaimStatus

log = logging.getLogger("reconciler.kube.routes")

PodKey = tuple[str, str]
WAKE_CHECK_S = 5.0


def route_value(route: Route) -> str:
    """The annotation's JSON, as the guide shows it."""
    doc: dict[str, Any] = {"model": route.model, "port": route.port, "state": route.state}
    if route.reason:
        doc["reason"] = route.reason
    doc["wakeByRequest"] = route.wake_by_request
    return json.dumps(doc, separators=(",", ":"))


def _pointer(key: str) -> str:
    return "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1")


class RoutePublisher:
    def __init__(self, api: KubeApi, desired: KubeDesired, deps: Deps, clock: Clock) -> None:
        self.api = api
        self.desired = desired
        self.w, self.b = deps.reader, deps.books
        self.clock = clock
        self._marked: set[ClaimKey] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._routes: dict[ClaimKey, set[PodKey]] = {}  # Pods that carry a claim's route
        # requests taken, by claim: (Pod, value, the route name of the replica asked to wake)
        self._wakes: dict[ClaimKey, tuple[PodKey, str, str | None]] = {}
        self.patches = 0
        desired.on_pod_changed(self.on_pod)

    # ---- what the Pods say ------------------------------------------------------------------

    def on_pod(self, before: PodAgent | None, after: PodAgent | None) -> None:
        pod = before or after
        assert pod is not None
        where = (pod.namespace, pod.name)
        old = before.annotations if before is not None else {}
        new = after.annotations if after is not None else {}
        for key in old.keys() | new.keys():
            if key.startswith(ROUTE_PREFIX):
                claim = (pod.namespace, key[len(ROUTE_PREFIX):])
                if key in new:
                    self._routes.setdefault(claim, set()).add(where)
                else:
                    self._routes.get(claim, set()).discard(where)
            elif key.startswith(WAKE_PREFIX) and key in new and new[key] != old.get(key):
                self._wake_requested((pod.namespace, key[len(WAKE_PREFIX):]), where, new[key])
        if after is None or (before is not None and before.url != after.url):
            for claim, pods in self._routes.items():
                if where in pods:
                    self.mark(claim)

    def _members(self, key: ClaimKey) -> list[ClaimStatus]:
        """The statuses of the claim's replicas, replica 0 (the claim's own) first."""
        st = self.w.store.get(key)
        return ([st] if st is not None else []) + self.w.store.replicas_of(key)

    def _wake_requested(self, key: ClaimKey, pod: PodKey, value: str) -> None:
        members = self._members(key)
        claim = self.desired.claim(key)
        model = claim.model_name if claim is not None else \
            members[0].model_name if members else None
        woken: str | None = None
        if model is not None and not any(m.phase == ACTIVE for m in members):
            # one replica, not each: the lowest that sleeps, else replica 0 (as before)
            which = next((m.key for m in members if m.phase == SLEEPING), key)
            woken = route_name(model, which)
            _, new = self.b.wakes.request(woken, which, self.clock.now(), self.clock.wall())
            if new:
                log.info("claim %s: wake requested on %s/%s", key_text(which), *pod)
                self.b.kick_claim(which)
        self._wakes[key] = (pod, value, woken)
        self.mark(key)

    # ---- marking and publishing -------------------------------------------------------------

    def mark(self, key: ClaimKey) -> None:
        self._marked.add(base_key(key))  # a replica's route is on its claim's annotation
        self._wake.set()

    def mark_all(self) -> None:
        self._marked |= set(self._routes) | {base_key(k) for k in self.w.store.keys()} \
            | set(self._wakes)
        self._wake.set()

    async def sync_model(self, model: str) -> bool:
        """Publish the route of ``model`` (a replica's route name: its claim's) now."""
        model = model_of_route(model)
        key = self.w.desired.by_model(model) or self.w.store.by_model(model)
        if key is None:
            return True
        try:
            await self._publish(key)
            return True
        except Exception as err:
            log.warning("route of %s: %s", model, err)
            self.mark(key)
            return False

    async def publish(self, key: ClaimKey) -> None:
        """The claim's route on its Pod now (before its Active status is written); raises
        when the API server refuses it."""
        await self._publish(base_key(key))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="routes")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancelled(task)

    async def _run(self) -> None:
        while True:
            try:  # not wait_for: on 3.11 it swallows a cancel that comes with a mark
                async with asyncio.timeout(WAKE_CHECK_S):
                    await self._wake.wait()
            except TimeoutError:
                self._marked |= set(self._wakes)  # expired requests
            self._wake.clear()
            marked, self._marked = self._marked, set()
            failed = False
            for key in sorted(marked):
                try:
                    await self._publish(key)
                except Exception as err:
                    failed = True
                    self._marked.add(key)
                    log.warning("claim %s: publishing its route failed: %s", key_text(key), err)
            await self.clock.sleep(1.0 if failed else 0.02)  # coalesce a burst of changes

    async def _publish(self, key: ClaimKey) -> None:
        """The claim's route on the Pod of each of its replicas (``reconciler.replicas``: the
        seed's one annotation per claim, on every Pod that serves it), none elsewhere."""
        st = self.w.store.get(key)
        urls = {a.name: a.url for a, _ in self.desired.agents()}

        def healthy(agent: str) -> bool:
            obs = self.w.cache.last(agent)
            return obs is not None and obs.ok

        targets: dict[PodKey, str] = {}
        for member in self._members(key):
            route = route_of(member, urls, healthy, self.b.holds, self.b.wakes)
            if route is not None and member.instance is not None:
                targets.setdefault(pod_of(member.instance.agent), route_value(route))
        annotation = ROUTE_PREFIX + key[1]
        for pod in sorted(self._routes.get(key, set()) | set(targets)):
            agent = self.desired.pod(*pod)
            if agent is None:
                continue
            want = targets.get(pod)
            if agent.annotations.get(annotation) != want:
                await self._patch(pod, {annotation: want})
        await self._wake_done(key, st.model_name if st else None)

    async def _wake_done(self, key: ClaimKey, model: str | None) -> None:
        taken = self._wakes.get(key)
        if taken is None:
            return
        pod, value, woken = taken
        if model is not None and woken is not None and self.b.wakes.get(woken) is not None \
                and not any(m.phase == ACTIVE for m in self._members(key)):
            return
        path = _pointer(WAKE_PREFIX + key[1])
        try:
            await self.api.patch(PODS, pod[0], pod[1], [{"op": "test", "path": path,
                                                         "value": value},
                                                        {"op": "remove", "path": path}],
                                 JSON_PATCH)
            self.patches += 1
            log.info("claim %s: wake request removed from %s/%s", key_text(key), *pod)
        except (Conflict, KubeError) as err:
            if err.status not in (404, 409, 422):
                raise
        if self._wakes.get(key) == taken:
            del self._wakes[key]

    async def _patch(self, pod: PodKey, annotations: dict[str, str | None]) -> None:
        await self.api.patch(PODS, pod[0], pod[1], {"metadata": {"annotations": annotations}},
                             MERGE_PATCH)
        self.patches += 1
