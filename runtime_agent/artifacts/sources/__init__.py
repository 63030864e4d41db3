"""Where artifacts come from: the Hugging Face Hub, S3 (and S3-compatible stores), local paths.

Each source answers two blocking calls, run in a worker thread: ``plan`` (the files, their
sizes and checksums, fixed before the first byte moves) and ``fetch`` (one file's bytes from an
offset into a writer). Failures are ``FetchError`` with a kind that says whose fault it is.
"""

from __future__ import annotations

from runtime_agent.artifacts.sources.base import FetchError, FetchKind, Source

__all__ = ["FetchError", "FetchKind", "Source"]
