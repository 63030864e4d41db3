"""A local path (a network mount, a volume) as a source: its files copied into the cache.

Only paths inside the allowed roots are read (``guard.paths`` decides, through
``urls.local_path_problem``, before the download starts); every file is resolved again here,
so a symlink inside the tree cannot lead the copy outside the roots. Local files carry no
checksum: sizes are checked.
"""

from __future__ import annotations

import os
from pathlib import Path

from guard.paths import inside

from runtime_agent.artifacts.manifest import Plan, PlannedFile
from runtime_agent.artifacts.sources.base import FetchError, FetchKind
from runtime_agent.artifacts.verify import HashingWriter

CHUNK = 4 << 20


class LocalSource:
    def __init__(self, path: str, roots: tuple[Path, ...]) -> None:
        self._path = Path(path)
        self._roots = tuple(Path(os.path.realpath(r)) for r in roots)

    def _checked(self, path: Path) -> Path:
        real = Path(os.path.realpath(path))
        if not inside(real, self._roots):
            raise FetchError(FetchKind.REFUSED, f"{path} leads outside the allowed roots")
        return real

    def plan(self) -> Plan:
        root = self._checked(self._path)
        try:
            if root.is_file():
                return Plan((PlannedFile(root.name, root.stat().st_size, locator=str(root)),))
            files = []
            for dirpath, _, names in os.walk(root):
                for name in names:
                    full = self._checked(Path(dirpath) / name)
                    rel = str((Path(dirpath) / name).relative_to(root))
                    files.append(PlannedFile(rel, full.stat().st_size, locator=str(full)))
        except OSError as exc:
            raise FetchError(FetchKind.NOT_FOUND, f"cannot read {self._path}: {exc}") from None
        if not files:
            raise FetchError(FetchKind.NOT_FOUND, f"{self._path} holds no files")
        return Plan(tuple(sorted(files, key=lambda f: f.path)))

    def fetch(self, file: PlannedFile, writer: HashingWriter, offset: int) -> None:
        try:
            with open(self._checked(Path(file.locator)), "rb") as src:
                src.seek(offset)
                while chunk := src.read(CHUNK):
                    writer.write(chunk)
        except FileNotFoundError:
            raise FetchError(FetchKind.CHANGED, f"{file.path} disappeared from {self._path}") \
                from None
