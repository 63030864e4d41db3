"""List-then-watch: a local copy of one resource kept current from the API server's watch.

The informer lists the resource once (learning the list's resourceVersion), then watches from
that version with bookmarks (``allowWatchBookmarks``: the server's periodic "nothing changed up
to version N" keeps our version current, so a reconnect resumes close to the present). When a
watch ends (the server's ``timeoutSeconds``, a dropped connection) it watches again from the
last version seen; when the server answers ``410 Gone`` (the version fell out of its history)
it lists again and reports the differences against its copy as changes.

A failed list or watch never deletes anything: the copy keeps its last good content until a
successful list says an object is gone (the claims of a silent API server keep running).

An ``optional`` resource (a custom resource added after the reconciler's first release, such as
ModelRoute) may not be installed: a list answered ``404`` counts as synced with nothing in it
(the reconciler does not wait forever for a CRD an older installation never applied), and the
informer lists again with its backoff until the resource appears.

Every change calls ``on_change(old, new)`` (``new`` None: deleted), on the event loop, after the
copy was updated. ``synced`` is set after the first successful list.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from contract.clock import Clock, LoopClock
from reconciler.kube.api import Gone, KubeApi, NotFound, Obj, Resource
from reconciler.runtime.ratelimit import backoff_delay
from reconciler.runtime.tasks import cancelled

log = logging.getLogger("reconciler.kube.informer")

ObjKey = tuple[str, str]  # (namespace, name)
OnChange = Callable[[Obj | None, Obj | None], None]


def obj_key(obj: Obj) -> ObjKey:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def namespaced_key(obj: Obj) -> ObjKey:
    """``obj_key`` with a namespace left out read as ``default``, as the API server reads it."""
    namespace, name = obj_key(obj)
    return namespace or "default", name


def resource_version(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


class Informer:
    def __init__(self, api: KubeApi, res: Resource, on_change: OnChange, *,
                 namespace: str | None = None, label_selector: str | None = None,
                 watch_timeout: int = 300, clock: Clock | None = None,
                 retry: tuple[float, float] = (0.5, 30.0), optional: bool = False) -> None:
        self.api = api
        self.optional = optional
        self.res = res
        self.on_change = on_change
        self.namespace = namespace
        self.label_selector = label_selector
        self.watch_timeout = watch_timeout
        self.clock: Clock = clock or LoopClock()
        self.retry = retry
        self.store: dict[ObjKey, Obj] = {}
        self.version = ""
        self.synced = asyncio.Event()
        self.lists = 0
        self.watches = 0
        self._task: asyncio.Task[None] | None = None

    def get(self, key: ObjKey) -> Obj | None:
        return self.store.get(key)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name=f"informer-{self.res.plural}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancelled(task)

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                if not self.version:
                    await self.relist()
                await self._watch()
                failures = 0
            except Gone:
                log.info("%s: resource version %s is gone; listing again", self.res.plural,
                         self.version)
                self.version = ""
            except asyncio.CancelledError:
                raise
            except Exception as err:  # network, 5xx, a bad line: keep the copy, try again
                delay = backoff_delay(failures, *self.retry)
                failures += 1
                if isinstance(err, NotFound) and self.optional:
                    self.synced.set()  # not installed (its CRD not applied): none, for now
                log.warning("%s: %s; keeping what is known and trying again in %.1f s",
                            self.res.plural, str(err) or type(err).__name__, delay)
                await self.clock.sleep(delay)

    async def relist(self) -> None:
        items, version = await self.api.list(self.res, self.namespace, self.label_selector)
        self.lists += 1
        seen: dict[ObjKey, Obj] = {obj_key(o): o for o in items}
        old = self.store
        self.store = dict(seen)
        self.version = version
        for key, obj in seen.items():
            before = old.get(key)
            if before is None or resource_version(before) != resource_version(obj):
                self._notify(before, obj)
        for key in old.keys() - seen.keys():  # only a successful list deletes
            self._notify(old[key], None)
        self.synced.set()

    async def _watch(self) -> None:
        self.watches += 1
        async for event in self.api.watch(self.res, self.version, self.namespace,
                                          self.watch_timeout, self.label_selector):
            kind, obj = event.get("type"), event.get("object") or {}
            version = resource_version(obj)
            if kind == "BOOKMARK":
                self.version = version or self.version
                continue
            if kind not in ("ADDED", "MODIFIED", "DELETED"):
                continue
            obj.setdefault("kind", self.res.kind)
            obj.setdefault("apiVersion", self.res.api_version)
            key = obj_key(obj)
            before = self.store.get(key)
            if kind == "DELETED":
                self.store.pop(key, None)
                self._notify(before, None)
            else:
                self.store[key] = obj
                self._notify(before, obj)
            self.version = version or self.version

    def _notify(self, old: Obj | None, new: Obj | None) -> None:
        try:
            self.on_change(old, new)
        except Exception:
            log.exception("%s: handling a change failed", self.res.plural)


def meta(obj: Obj | None) -> dict[str, Any]:
    return dict((obj or {}).get("metadata") or {})


def only_status(old: Obj, new: Obj) -> bool:
    """The change touched nothing but the status and the resourceVersion (our own status
    write, coming back through the watch)."""
    def rest(obj: Obj) -> Obj:
        m = {k: v for k, v in meta(obj).items() if k not in ("resourceVersion", "managedFields")}
        return {**{k: v for k, v in obj.items() if k not in ("status", "metadata")}, "m": m}
    return rest(old) == rest(new)
