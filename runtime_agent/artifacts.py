"""Served-artifact markers under the weight cache directory (``cached_artifacts`` in the snapshot).

When an engine first becomes active, the agent notes its artifact URL in a small file under
``<cache>/.aibrix/served/``. The controller prefers Pods whose node has served a model before,
since its weights are already on disk. The list lives in memory; files are read once at start.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


class ArtifactMarkers:
    def __init__(self, cache_dir: Path | None) -> None:
        self._dir = cache_dir / ".aibrix" / "served" if cache_dir else None
        self._served: set[str] = set()

    def load(self) -> None:
        """Read existing markers (blocking; call in a thread)."""
        if self._dir is None or not self._dir.is_dir():
            return
        for path in self._dir.glob("*.json"):
            try:
                url = json.loads(path.read_text())["artifact_url"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if isinstance(url, str):
                self._served.add(url)

    def known(self, url: str) -> bool:
        return url in self._served

    def note(self, url: str) -> bool:
        """Remember ``url``; True when it is new and a marker should be written."""
        if url in self._served:
            return False
        self._served.add(url)
        return True

    def write(self, url: str) -> None:
        """Write a marker for ``url`` (blocking; call in a thread)."""
        if self._dir is None:
            return
        self._dir.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha256(url.encode()).hexdigest()[:24] + ".json"
        tmp = self._dir / f".{name}.tmp"
        tmp.write_text(json.dumps({"artifact_url": url}))
        os.replace(tmp, self._dir / name)

    def listing(self) -> list[str]:
        return sorted(self._served)
