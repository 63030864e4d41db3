"""The reconciler on a directory: ModelClaims and WarmPools as manifest files, statuses in files.

The directory mode beside ``reconciler.kube``; both run the same core (``reconciler.core``:
placing, sleep and wake, KV division, drain, routes, the HTTP API) and neither imports the
other (``.importlinter``).

| module | what |
|---|---|
| ``desired.py`` | the manifest directory as the reconcilers' ``Desired`` (last valid kept) |
| ``check.py`` | ``claims check FILE|DIR``: manifests checked by the same parser, no effect |
| ``app.py`` | wiring: directory sources, statuses in files (``runtime-agent reconcile --claims``) |
| ``embedded.py`` | the reconciler beside one agent, that agent its pool (``serve --claims``) |
"""
