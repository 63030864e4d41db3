"""A Kubernetes API server stand-in for tests and benchmarks: kmock's emulator, made strict.

``ApiServer`` is kmock's ``KubernetesEmulator`` (the mock server from kopf's author: HTTP
serving, request parsing, API discovery, Status errors) with the behaviours a real API server
has and the emulator lacks, added in its own handler (``_handle``), each as the Kubernetes API
documentation describes it (kubernetes.io/docs/reference/using-api/api-concepts/):

* **Resource versions.** Every write bumps one global counter; each object carries its
  ``metadata.resourceVersion``; a list answers the version it reflects.
* **Watches** from a version: the events after it, then live ones; ``allowWatchBookmarks``
  sends a ``BOOKMARK`` (an object with only ``metadata.resourceVersion``) every
  ``bookmark_interval``; ``timeoutSeconds`` ends the stream. A version older than the history
  kept (``compact``) answers a ``410 Gone`` ERROR event ("too old resource version"). With a
  label selector, an object that stops matching is a ``DELETED`` event.
* **Optimistic concurrency.** A ``PUT``, or a patch whose result carries
  ``metadata.resourceVersion``, applies only to that version: otherwise ``409 Conflict``.
* **The status subresource** (for resources in ``status_subresource``): ``/status`` writes
  change only ``.status``; writes to the object ignore ``.status``; only a change of the spec
  (anything but metadata and status) bumps ``metadata.generation``.
* **Finalizers.** A DELETE of an object with finalizers only sets ``deletionTimestamp`` (and
  bumps the generation); the object goes once the last finalizer is removed.
* **Patches**: JSON merge patch (RFC 7386), JSON patch (RFC 6902, with ``test``; a failed test
  is ``422``), strategic merge patch taken as a merge patch (enough for maps).
* **Faults on demand**: ``fail(method, path_part, status, times)``; ``drop_watches`` ends every
  open watch (as an API server restart does).

``validate(resource, old, new)`` may refuse a create or update with ``422 Invalid`` (a hook for
admission checks; the CRD's schema is compared with the parser in ``test_kube_manifests.py``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import rendering

Obj = dict[str, Any]
ResKey = tuple[str, str, str]  # (group, version, plural)
Validator = Callable[[ResKey, Obj | None, Obj], "str | None"]


class ApiStatus(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def body(self) -> Obj:
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "code": self.code, "reason": self.reason, "message": self.message}


def now_text() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if term.startswith("!"):
            if term[1:] in labels:
                return False
        elif "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term not in labels:
            return False
    return True


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    status_subresource: set[str] = attrs.field(factory=lambda: {"modelclaims", "modelroutes"})
    bookmark_interval: float = 1.0
    history: int = 100_000
    validate: Validator | None = None
    version: int = attrs.field(default=0, init=False)
    store: dict[tuple[ResKey, str, str], Obj] = attrs.field(factory=dict, init=False)
    log: dict[ResKey, list[tuple[int, str, Obj, Obj | None]]] = attrs.field(factory=dict,
                                                                            init=False)
    oldest: dict[ResKey, int] = attrs.field(factory=dict, init=False)
    changed: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    faults: list[list[Any]] = attrs.field(factory=list, init=False)
    counts: dict[str, int] = attrs.field(factory=dict, init=False)
    _epoch: int = attrs.field(default=0, init=False)

    # ---- the test's hands -------------------------------------------------------------------

    def fail(self, method: str, path_part: str, status: int, times: int = 1) -> None:
        self.faults.append([method.upper(), path_part, status, times])

    def compact(self, res: ResKey | None = None) -> None:
        """Forget the history: a watch from an older version gets 410 Gone."""
        for key in [res] if res else list(self.log):
            self.log[key] = []
            self.oldest[key] = self.version

    def drop_watches(self) -> None:
        self._epoch += 1
        self._wake()

    def get_obj(self, plural: str, namespace: str, name: str) -> Obj | None:
        for (res, ns, n), obj in self.store.items():
            if res[2] == plural and ns == namespace and n == name:
                return obj
        return None

    def all_of(self, plural: str) -> list[Obj]:
        return [o for (res, _, _), o in self.store.items() if res[2] == plural]

    # ---- serving ----------------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.resource.plural is None:
            return await super()._handle(request)
        res: ResKey = (request.resource.group or "", request.resource.version or "",
                       request.resource.plural)
        method = str(request.method.value).upper()
        verb = "WATCH" if request.params.get("watch") in ("true", "1") else method
        self.counts[verb] = self.counts.get(verb, 0) + 1
        try:
            for fault in self.faults:
                if fault[3] > 0 and fault[0] == method and fault[1] in str(request.url.path):
                    fault[3] -= 1
                    raise ApiStatus(fault[2], {409: "Conflict", 410: "Gone"}.get(
                        fault[2], "InternalError"), "injected by the test")
            if verb == "WATCH":
                return await self._watch(request, res)
            doc = await self._serve(request, res, method)
            return aiohttp.web.json_response(doc)
        except ApiStatus as err:
            return aiohttp.web.json_response(err.body(), status=err.code)

    async def _serve(self, request: rendering.Request, res: ResKey, method: str) -> Obj:
        ns, name, sub = request.namespace or "", request.name, request.subresource
        body = request.data
        if method == "GET" and name is None:
            items = [copy.deepcopy(o) for (r, n, _), o in sorted(self.store.items())
                     if r == res and (not ns or n == ns)
                     and selector_matches(request.params.get("labelSelector", ""),
                                          (o["metadata"].get("labels") or {}))]
            return {"kind": "List", "apiVersion": "v1", "items": items,
                    "metadata": {"resourceVersion": str(self.version)}}
        if method == "POST" and name is None:
            return self._create(res, ns, body)
        key = (res, ns, name or "")
        current = self.store.get(key)
        if current is None:
            raise ApiStatus(404, "NotFound", f'{res[2]} "{name}" not found')
        if method == "GET":
            return copy.deepcopy(current)
        if method == "DELETE":
            return self._delete(res, key, current)
        if method == "PUT":
            return self._update(res, key, current, body, sub, require_version=True)
        if method == "PATCH":
            kind = request.headers.get("Content-Type", "").split(";")[0]
            if kind == "application/json-patch+json":
                try:
                    new = jsonpatch.apply_patch(current, body)
                except jsonpatch.JsonPatchTestFailed as err:
                    raise ApiStatus(422, "Invalid", f"the test operation failed: {err}") from None
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as err:
                    raise ApiStatus(422, "Invalid", str(err)) from None
            else:
                new = merge_patch(current, body)
            return self._update(res, key, current, new, sub, require_version=False)
        raise ApiStatus(405, "MethodNotAllowed", f"{method} is not allowed here")

    # ---- writes -------------------------------------------------------------------------------

    def _bump(self) -> str:
        self.version += 1
        return str(self.version)

    def _emit(self, res: ResKey, kind: str, obj: Obj, old: Obj | None) -> None:
        entries = self.log.setdefault(res, [])
        entries.append((self.version, kind, copy.deepcopy(obj), old))
        if len(entries) > self.history:
            dropped = entries[: len(entries) - self.history]
            del entries[: len(entries) - self.history]
            self.oldest[res] = dropped[-1][0]
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def _check(self, res: ResKey, old: Obj | None, new: Obj) -> None:
        if self.validate is not None:
            problem = self.validate(res, old, new)
            if problem:
                raise ApiStatus(422, "Invalid", problem)

    def _create(self, res: ResKey, ns: str, body: Obj) -> Obj:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta["namespace"] = ns or meta.get("namespace") or "default"
        key = (res, meta["namespace"], meta.get("name") or "")
        if key in self.store:
            raise ApiStatus(409, "AlreadyExists", f'{res[2]} "{key[2]}" already exists')
        if res[2] in self.status_subresource:
            obj.pop("status", None)
        self._check(res, None, obj)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_text(), generation=1,
                    resourceVersion=self._bump())
        self.store[key] = obj
        self._emit(res, "ADDED", obj, None)
        return copy.deepcopy(obj)

    def _update(self, res: ResKey, key: tuple[ResKey, str, str], current: Obj, body: Obj,
                sub: str | None, require_version: bool) -> Obj:
        sent = str((body.get("metadata") or {}).get("resourceVersion") or "")
        if (require_version or sent) and sent != current["metadata"]["resourceVersion"]:
            raise ApiStatus(409, "Conflict", "the object has been modified; please apply "
                            "your changes to the latest version and try again")
        new = copy.deepcopy(current)
        if sub == "status":
            new["status"] = copy.deepcopy(body.get("status"))
        else:
            keep = {k: current["metadata"].get(k) for k in (
                "uid", "creationTimestamp", "deletionTimestamp", "generation", "namespace",
                "name")}
            new = copy.deepcopy(body)
            new["metadata"] = {**(body.get("metadata") or {}), **keep}
            if res[2] in self.status_subresource and "status" in current:
                new["status"] = copy.deepcopy(current["status"])
            elif res[2] in self.status_subresource:
                new.pop("status", None)
            spec_of = {k: v for k, v in new.items() if k not in ("metadata", "status")}
            spec_was = {k: v for k, v in current.items() if k not in ("metadata", "status")}
            if spec_of != spec_was:
                new["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
            self._check(res, current, new)
        meta = new["metadata"]
        if current["metadata"].get("deletionTimestamp") and not meta.get("finalizers"):
            meta["resourceVersion"] = self._bump()
            del self.store[key]
            self._emit(res, "DELETED", new, current)
            return copy.deepcopy(new)
        if new == current:
            return copy.deepcopy(current)  # a no-op write keeps the version (as the API does)
        meta["resourceVersion"] = self._bump()
        self.store[key] = new
        self._emit(res, "MODIFIED", new, current)
        return copy.deepcopy(new)

    def _delete(self, res: ResKey, key: tuple[ResKey, str, str], current: Obj) -> Obj:
        meta = current["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                new = copy.deepcopy(current)
                new["metadata"].update(deletionTimestamp=now_text(),
                                       deletionGracePeriodSeconds=0,
                                       generation=int(meta.get("generation", 1)) + 1,
                                       resourceVersion=self._bump())
                self.store[key] = new
                self._emit(res, "MODIFIED", new, current)
                return copy.deepcopy(new)
            return copy.deepcopy(current)
        gone = copy.deepcopy(current)
        gone["metadata"]["resourceVersion"] = self._bump()
        del self.store[key]
        self._emit(res, "DELETED", gone, current)
        return gone

    # ---- watches ------------------------------------------------------------------------------

    async def _watch(self, request: rendering.Request,
                     res: ResKey) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        params = request.params
        ns = request.namespace or ""
        selector = params.get("labelSelector", "")
        bookmarks = params.get("allowWatchBookmarks") in ("true", "1")
        timeout = float(params.get("timeoutSeconds") or 1800)
        since = params.get("resourceVersion") or ""
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(raw)

        async def send(kind: str, obj: Obj) -> None:
            await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        epoch = self._epoch
        if since in ("", "0"):
            for (r, n, _), o in sorted(self.store.items()):
                if r == res and (not ns or n == ns) and selector_matches(
                        selector, o["metadata"].get("labels") or {}):
                    await send("ADDED", o)
            position = self.version
        else:
            position = int(since)
            if position < self.oldest.get(res, 0):
                await send("ERROR", ApiStatus(410, "Expired", f"too old resource version: "
                                              f"{position} ({self.oldest[res]})").body())
                return resp
        try:
            while loop.time() < deadline and epoch == self._epoch:
                for rv, kind, obj, old in list(self.log.get(res, [])):
                    if rv <= position:
                        continue
                    position = rv
                    if ns and obj["metadata"].get("namespace") != ns:
                        continue
                    now_in = selector_matches(selector, obj["metadata"].get("labels") or {})
                    was_in = old is not None and selector_matches(
                        selector, old["metadata"].get("labels") or {})
                    if now_in:
                        await send("ADDED" if kind == "MODIFIED" and not was_in else kind, obj)
                    elif was_in:
                        await send("DELETED", obj)
                entries = self.log.get(res, [])
                if entries and entries[-1][0] > position:
                    continue  # written while we sent: send it before waiting
                quiet_at = max(position, self.version)  # nothing of ours up to here is unsent
                changed = self.changed
                wait = min(self.bookmark_interval, max(0.0, deadline - loop.time()))
                try:
                    await asyncio.wait_for(changed.wait(), wait)
                except TimeoutError:
                    if bookmarks:
                        position = quiet_at
                        await send("BOOKMARK", {"kind": "", "apiVersion": "",
                                                "metadata": {"resourceVersion": str(position)}})
        except (ConnectionResetError, asyncio.CancelledError):
            return resp
        return resp
