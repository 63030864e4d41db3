"""ModelRoutes on Kubernetes: the objects the ModelRoute informer holds, taken by the rule both
run modes share (``reconciler.selection.route_manifests.routes_from``).

A route the parser refuses is an ``InvalidRoute`` problem; one named like a claim's modelName,
or like another route (in any namespace: clients send the name alone, and the first by
namespace keeps it), is a ``Duplicate``; only the others are served, exactly as from the claims
directory. ``KubeDesired`` takes the routes again after a route's spec changes or a claim whose
modelName is a route's name comes or goes; our own status writes (nothing but ``status`` and
the resourceVersion changed) take nothing again.
"""

from __future__ import annotations

from collections.abc import Mapping

from reconciler.desired import ClaimKey
from reconciler.kube.api import Obj
from reconciler.kube.informer import ObjKey, namespaced_key, only_status
from reconciler.model.manifests import Problem, RouteDocument
from reconciler.selection.route_manifests import routes_from
from reconciler.selection.route_spec import Route


class RouteObjects:
    """Every ModelRoute object by (namespace, name), taken or not."""

    def __init__(self) -> None:
        self.objects: dict[ObjKey, Obj] = {}
        self.names: frozenset[str] = frozenset()  # every route's name, taken or not

    def change(self, old: Obj | None, new: Obj | None) -> bool:
        """Keep the informer's change; True when the routes must be taken again."""
        key = namespaced_key(new or old or {})
        if new is None:
            self.objects.pop(key, None)
        else:
            self.objects[key] = new
        if old is not None and new is not None and only_status(old, new):
            return False
        self.names = frozenset(name for _, name in self.objects)
        return True

    def take(self, models: Mapping[str, ClaimKey]
             ) -> tuple[dict[str, Route], tuple[Problem, ...]]:
        """The routes served by name, and a problem for each route object not taken."""
        docs = [RouteDocument(name, ns, "", obj)
                for (ns, name), obj in sorted(self.objects.items())]
        return routes_from(docs, models)

    def get(self, key: ObjKey) -> Obj | None:
        return self.objects.get(key)
