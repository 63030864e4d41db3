"""The weight cache: artifacts staged on the node's disk before engines need them.

``cache.ArtifactCache`` keeps one entry per artifact under ``AIBRIX_WEIGHT_CACHE_DIR``
(``store``: ready entries, downloads in progress, and how one becomes the other), fetched from
the Hugging Face Hub, S3 or an allowed local path (``sources``), checked on arrival
(``verify``, ``transfer``), with disk room and speed decided by plain functions (``planning``).
``staging.EngineStager`` is the face an engine start sees. The HTTP routes are
``runtime_agent.api.artifacts``; the CLI commands ``commands``.
"""
