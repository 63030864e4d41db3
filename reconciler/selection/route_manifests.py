"""``ModelRoute`` manifests, taken or refused (issue 24): one rule for both run modes.

Each route arrives as written (``RouteDocument``): from a file of the claims directory (the
manifests module sits below the selection package and must not import it) or, on Kubernetes,
as the object the ModelRoute informer holds. Here each is parsed by
``reconciler.selection.route_spec.parse_route`` and becomes a route the door can serve, or a
``Problem`` saying what to fix, as an invalid claim does. A route may not take a name a claim's
modelName already serves: the door looks exact names up first, so such a route could never be
asked for, and silently never being used is worse than being told.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from reconciler.model.manifests import DUPLICATE, ROUTE_KIND, Problem, RouteDocument
from reconciler.selection.route_spec import Route, RouteError, parse_route

INVALID_ROUTE = "InvalidRoute"


def routes_from(docs: Iterable[RouteDocument], models: Mapping[str, tuple[str, str]]
                ) -> tuple[dict[str, Route], tuple[Problem, ...]]:
    """The valid routes by name, and a problem for each one not taken: invalid (saying what to
    fix), a name given twice, or a name a claim's modelName already serves (an exact name
    always reaches its claim, so such a route could never be asked for)."""
    routes: dict[str, Route] = {}
    problems: list[Problem] = []
    for doc in docs:
        why: tuple[str, str]
        try:
            route = parse_route(doc.obj)
        except RouteError as bad:
            why = (INVALID_ROUTE, str(bad))
        else:
            if route.name in routes:
                why = (DUPLICATE, f"route {route.name!r} is defined more than once")
            elif route.name in models:
                why = (DUPLICATE, f"{route.name!r} is the modelName of claim "
                                  f"{'/'.join(models[route.name])}; give the route another name")
            else:
                routes[route.name] = route
                continue
        problems.append(Problem(ROUTE_KIND, doc.name, *why, doc.namespace, doc.source))
    return routes, tuple(problems)
