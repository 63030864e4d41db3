"""The HTTP surface: routes, request models, the snapshot, the events feed and the metrics."""
