"""The environment variables the agent puts into every engine it starts.

Re-adoption reads them back from ``/proc/<pid>/environ``, so a reused PID is never mistaken
for an engine. They live apart from ``registry.record`` so that what only needs the names
(the launcher, the process identity check) does not load the record's models at start-up.
"""

from __future__ import annotations

ENV_ENGINE_ID = "AIBRIX_ENGINE_ID"
ENV_STATE_DIR = "AIBRIX_AGENT_STATE_DIR"
ENV_ENGINE_SPEC = "AIBRIX_ENGINE_SPEC"
