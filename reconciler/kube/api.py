"""The Kubernetes API client: the only code in the reconciler that talks to the API server.

It uses ``kubernetes_asyncio`` for configuration (in-cluster service account or kubeconfig),
authentication and transport, and reads every answer as plain JSON (``_preload_content=False``):
the reconciler keeps objects as dicts, and decoding ten thousand objects into generated model
classes would cost more than the rest of a relist. Errors are ``KubeError`` with the HTTP
status; ``Conflict`` (409) and ``Gone`` (410) are the two the callers act on.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

log = logging.getLogger("reconciler.kube.api")

Obj = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class KubeError(Exception):
    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message


class Conflict(KubeError):
    """409: the object changed since it was read (or already exists)."""


class Gone(KubeError):
    """410: the resource version is too old to watch from; list again."""


class NotFound(KubeError):
    """404."""


def error_for(status: int, body: bytes) -> KubeError:
    message, reason = body.decode(errors="replace")[:500], ""
    try:
        doc = json.loads(body)
        if isinstance(doc, dict):
            message, reason = str(doc.get("message", message)), str(doc.get("reason", ""))
    except ValueError:
        pass
    cls = {409: Conflict, 410: Gone, 404: NotFound}.get(status, KubeError)
    return cls(status, message, reason)


def resource_of(path: str) -> str:
    """``/apis/g/v/namespaces/ns/plural/name/status`` -> ``plural/status`` (a metric label with
    few values, never an object's name)."""
    parts = [p for p in path.split("/") if p]
    parts = parts[3:] if parts[:1] == ["apis"] else parts[2:]
    if parts[:1] == ["namespaces"]:
        parts = parts[2:]
    return "/".join(parts[:1] + parts[2:3])


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if namespace is not None:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{name}"
        if subresource is not None:
            base += f"/{subresource}"
        return base


CLAIMS = Resource("model.aibrix.ai", "v1alpha1", "modelclaims", "ModelClaim")
ROUTES = Resource("model.aibrix.ai", "v1alpha1", "modelroutes", "ModelRoute")
PODS = Resource("", "v1", "pods", "Pod")
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")
EVENTS = Resource("", "v1", "events", "Event")


class KubeApi:
    """Requests to the API server. ``on_request(verb, resource, status)`` counts them."""

    def __init__(self, api_client: k8s_client.ApiClient,
                 on_request: Callable[[str, str, int], None] | None = None) -> None:
        self._client = api_client
        self._on_request = on_request

    async def close(self) -> None:
        await self._client.close()

    async def _raw(self, method: str, path: str, query: Mapping[str, str] | None = None,
                   body: Any = None, content_type: str | None = None,
                   timeout: float | None = 30.0) -> aiohttp.ClientResponse:
        headers = {"Accept": "application/json"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        elif body is not None:
            headers["Content-Type"] = "application/json"
        resp: aiohttp.ClientResponse = await self._client.call_api(
            path, method, query_params=list((query or {}).items()), header_params=headers,
            body=body, auth_settings=["BearerToken"], _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=10))
        return resp

    async def request(self, method: str, path: str, query: Mapping[str, str] | None = None,
                      body: Any = None, content_type: str | None = None) -> Obj:
        """One call; its JSON answer, or ``KubeError``."""
        resp = await self._raw(method, path, query, body, content_type)
        try:
            raw = await resp.read()
        finally:
            resp.release()
        self._count(method, path, resp.status)
        if not 200 <= resp.status < 300:
            raise error_for(resp.status, raw)
        doc = json.loads(raw) if raw else {}
        return doc if isinstance(doc, dict) else {}

    def _count(self, method: str, path: str, status: int) -> None:
        if self._on_request is not None:
            self._on_request(method, resource_of(path), status)

    async def list(self, res: Resource, namespace: str | None = None,
                   label_selector: str | None = None) -> tuple[list[Obj], str]:
        query = {"labelSelector": label_selector} if label_selector else {}
        doc = await self.request("GET", res.path(namespace), query)
        items = doc.get("items") or []
        for item in items:  # a list drops each item's kind and apiVersion
            item.setdefault("kind", res.kind)
            item.setdefault("apiVersion", res.api_version)
        return items, str((doc.get("metadata") or {}).get("resourceVersion", ""))

    async def watch(self, res: Resource, resource_version: str, namespace: str | None = None,
                    timeout_seconds: int = 300,
                    label_selector: str | None = None) -> AsyncIterator[Obj]:
        """Watch events after ``resource_version`` (with bookmarks) until the server ends the
        stream; raises ``Gone`` when the version is too old."""
        query = {"watch": "true", "resourceVersion": resource_version,
                 "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)}
        if label_selector:
            query["labelSelector"] = label_selector
        resp = await self._raw("GET", res.path(namespace), query, timeout=timeout_seconds + 30)
        try:
            self._count("WATCH", res.path(), resp.status)
            if not 200 <= resp.status < 300:
                raise error_for(resp.status, await resp.read())
            while True:
                line = await resp.content.readline()
                if not line:
                    return
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    code = int(status.get("code") or 500)
                    raise error_for(code, json.dumps(status).encode())
                yield event
        finally:
            resp.release()

    async def get(self, res: Resource, namespace: str | None, name: str) -> Obj:
        return await self.request("GET", res.path(namespace, name))

    async def create(self, res: Resource, namespace: str | None, body: Obj) -> Obj:
        return await self.request("POST", res.path(namespace), body=body)

    async def replace(self, res: Resource, namespace: str | None, name: str, body: Obj) -> Obj:
        return await self.request("PUT", res.path(namespace, name), body=body)

    async def patch(self, res: Resource, namespace: str | None, name: str, body: Any,
                    content_type: str = MERGE_PATCH, subresource: str | None = None) -> Obj:
        return await self.request("PATCH", res.path(namespace, name, subresource), body=body,
                                  content_type=content_type)

    async def delete(self, res: Resource, namespace: str | None, name: str) -> Obj:
        return await self.request("DELETE", res.path(namespace, name))


async def connect(kubeconfig: str | None = None, context: str | None = None,
                  on_request: Callable[[str, str, int], None] | None = None) -> KubeApi:
    """A client from ``kubeconfig`` (or ``$KUBECONFIG``, ``~/.kube/config``), or the Pod's
    service account when none is given and the reconciler runs in a cluster."""
    configuration = k8s_client.Configuration()
    in_cluster = kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ
    if in_cluster:
        k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration)
    else:
        await k8s_config.load_kube_config(config_file=kubeconfig, context=context,
                                          client_configuration=configuration)
    log.info("kubernetes API at %s (%s)", configuration.host,
             "in-cluster" if in_cluster else kubeconfig or "kubeconfig")
    return KubeApi(k8s_client.ApiClient(configuration), on_request)
