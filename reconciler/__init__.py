"""The reconciler: level-based control loops that drive runtime agents over HTTP.

``reconciler.runtime`` is the controller machinery (clock, work queue, rate limiter, controller,
sources); it knows nothing of models or agents beyond the keys it is handed.
"""
