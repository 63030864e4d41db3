"""The reconciler on Kubernetes: ModelClaims and ModelRoutes as custom resources, pool Pods as
agents.

| module | what |
|---|---|
| ``api.py`` | the only code that talks to the API server (``kubernetes_asyncio``, raw JSON) |
| ``informer.py`` | list-then-watch with resource versions, bookmarks and a relist on 410 Gone |
| ``desired.py`` | ModelClaims, pool Pods and Deployments as the reconcilers' ``Desired`` |
| ``status.py`` | statuses through the status subresource (409: re-read, retry), finalizers |
| ``route_objects.py`` | ModelRoute objects, taken by the directory mode's rule |
| ``route_status.py`` | each ModelRoute's candidates and ``FailedScheduling`` in its status |
| ``routes.py`` | route and wake annotations on the Pods, patched minimally |
| ``events.py`` | Events, rate-limited and aggregated like client-go's recorder |
| ``leader.py`` | leader election on a ``coordination.k8s.io`` Lease |
| ``app.py`` | wiring (``runtime-agent reconcile --kubernetes``) |
"""
