"""What the reconciler is told: ModelClaims, warm pools and their sleep policies, parsed from YAML.

Everything here is a frozen value. Parsing never raises for bad content: each invalid object is
reported as a ``Problem`` next to the objects that parsed (``manifests.parse_manifests``).
"""
