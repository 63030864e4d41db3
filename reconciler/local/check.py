"""``claims check FILE|DIR...``: a manifest checked before it is dropped in, by the reconciler's
own parser, as ``kubectl apply --dry-run`` would.

The files are parsed together (``reconciler.model.manifests.parse_sources``, as the reconciler
parses its directory: duplicates across files count), nothing is started and nothing is sent
anywhere. Each problem is printed as the reconciler logs it, one line each; the exit code is 1
when there is any, 0 with a line saying what the files declare otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from reconciler.local.desired import SUFFIXES
from reconciler.model.manifests import NO_AGENTS, parse_sources

EXIT_INVALID = 1
EXIT_UNREADABLE = 7  # as the agent's serve: an input that cannot be read


def manifest_files(paths: Sequence[str]) -> tuple[list[Path], list[str]]:
    """The manifest files ``paths`` name (a directory: its ``*.yaml``/``*.yml``, as the
    reconciler reads it) and a line for each path that cannot be read."""
    files: list[Path] = []
    problems: list[str] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in SUFFIXES
                            and not p.name.startswith(".") and p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            problems.append(f"{raw}: no such file or directory")
    return files, problems


def check(paths: Sequence[str]) -> tuple[list[str], int]:
    """The lines to print and the exit code."""
    files, unreadable = manifest_files(paths)
    sources: list[tuple[str, str]] = []
    for path in files:
        try:
            sources.append((str(path), path.read_text("utf-8")))
        except (OSError, UnicodeDecodeError) as exc:
            unreadable.append(f"{path}: cannot be read ({exc})")
    if unreadable:
        return unreadable, EXIT_UNREADABLE
    result = parse_sources(sources)
    # a pool without agents is fine in a directory the embedded reconciler reads (its agent
    # is the pool): the reconciler does not report it either
    problems = [str(p) for p in result.problems if p.reason != NO_AGENTS]
    if problems:
        return problems, EXIT_INVALID
    what = f"{len(result.claims)} claim{'s' * (len(result.claims) != 1)}, " \
           f"{len(result.pools)} pool{'s' * (len(result.pools) != 1)}"
    return [f"valid: {what} in {len(files)} file{'s' * (len(files) != 1)}"], 0
