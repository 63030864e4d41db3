"""The reconciler: level-based control loops that drive runtime agents over HTTP.

Two run modes over one core. ``reconciler.local`` reads claims and pools from a manifest
directory and keeps statuses in files; ``reconciler.kube`` reads them from the Kubernetes API
and writes the status subresource. Neither imports the other; both hand the core
(``reconciler.core``: claims, placing, lifecycle, drain, KV division, observe, routes, status,
the HTTP API, the front door in ``reconciler.door``) a ``Desired`` (``reconciler.desired``) and
a ``StatusStore`` (``reconciler.store``). ``reconciler.cli`` is the command line of both.

``reconciler.runtime`` is the controller machinery (clock, work queue, rate limiter, controller,
sources); it knows nothing of models or agents beyond the keys it is handed.
"""
