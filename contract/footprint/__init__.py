"""A model's GPU figures from its artifact (weights, KV floor, footprint), for placing a claim
that declares no ``perGPU`` and for ``runtime-agent claims estimate``: ``estimate`` is pure,
``reading`` reads a model directory for it."""
