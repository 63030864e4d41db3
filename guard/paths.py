"""The one rule for every input that names a local file: inside the operator's roots, or refused.

Artifact URLs (``file:///PATH`` or ``/PATH``), LoRA adapter paths and anything else a caller may
name on this machine's disk are judged by ``judge_local_path``, so no route keeps a guard of its
own (the LoRA route's own check once let ``~root/.ssh``, ``etc/passwd``, ``" /etc"`` and
``file:///etc`` through, while the weight cache refused them). The rules, each with the hole it
closes:

* the text is judged as written, nothing is stripped: ``" /etc"`` is not an absolute path and is
  refused, not trimmed into one (a consumer that trims, or one that does not, must not decide);
* only absolute paths: ``~`` and ``~user`` (vLLM expands them) and relative paths (resolved
  against whatever working directory the engine has) are refused;
* ``file://`` is the same path only as ``file:///PATH``; ``file:/PATH``, ``file://HOST/PATH`` and
  any other spelling are refused;
* no ``.``, ``..`` or empty (``//``) component, no ``%`` (a consumer that percent-decodes would
  read ``%2e%2e`` as ``..``), no whitespace, no NUL or other control character;
* the path must lie inside a root both as written and after every symlink is resolved
  (``realpath``), so a link inside a root that leads out is refused;
* every refusal of a path outside the roots is the same status and the same message, decided
  before the disk is asked anything about the outside: the answer is no oracle of what exists
  there. Only a path inside the roots may be answered "does not exist" (404).

With no roots configured every local path is refused: the operator has allowed none.

The check runs ``realpath`` (blocking file-system calls): call it in a worker thread on an event
loop. What it cannot close: a root the operator lets others write to can have a link swapped
after the check; roots are the operator's trusted directories.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from msgspec import Struct

FILE_SCHEME = "file://"
MAX_PATH = 4096
# A Hugging Face repository id: NAME or ORG/NAME, as the Hub allows them (no "..", no "--"
# at the ends). Whatever is not one and is handed to an engine as a path is a local path.
HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_HUB_REPO_ID = re.compile(rf"{HUB_PART}(?:/{HUB_PART})?")


class Allowed(Struct, frozen=True):
    """A local path that may be read: ``path`` as written (``file://`` removed), ``real`` with
    every symlink resolved (inside a root too)."""

    path: str
    real: str


class Refused(Struct, frozen=True):
    """Why the path may not be read: the HTTP status that says so, and what to do instead."""

    status: int
    message: str


def outside_message(roots: Sequence[Path | str]) -> str:
    """The one message every refused spelling gets, whatever it is and whether it exists."""
    named = ", ".join(str(r) for r in roots) or ("none configured: start the agent with "
                                                   "--artifact-local-root DIR")
    return (f"local paths must lie inside the allowed roots ({named}), written as an absolute "
            "path or file:///PATH without '~', '.', '..', '//', '%', spaces or control "
            "characters")


def is_hub_repo_id(text: str) -> bool:
    """``NAME`` or ``ORG/NAME`` as the Hub spells repositories (no path tricks in it)."""
    return _HUB_REPO_ID.fullmatch(text) is not None and ".." not in text and "--" not in text


def _as_written(spelled: str) -> str | None:
    """The absolute path ``spelled`` names, or None when it is not one plainly written."""
    if not spelled or len(spelled) > MAX_PATH:
        return None
    if any(c.isspace() or not c.isprintable() or c == "%" for c in spelled):
        return None
    path = spelled[len(FILE_SCHEME):] if spelled.startswith(FILE_SCHEME) else spelled
    if not path.startswith("/"):  # relative, "~", "file:/x", "file://host/x", other schemes
        return None
    parts = path.split("/")[1:]
    if parts and parts[-1] == "":  # one trailing '/' names the same directory
        parts = parts[:-1]
    if any(p in ("", ".", "..") for p in parts):
        return None
    return path


def inside(path: str | Path, roots: Sequence[str | Path]) -> bool:
    """``path`` is one of ``roots`` or lies below one (as text: resolve both first)."""
    text = os.fspath(path)
    named = [os.fspath(r) for r in roots]
    return any(text == r or text.startswith(r.rstrip("/") + "/") for r in named)


def judge_local_path(spelled: str, roots: Sequence[Path | str]) -> Allowed | Refused:
    """Whether the local path ``spelled`` may be read, given the allowed ``roots``.

    Blocking (``realpath``): call in a thread from async code."""
    refused = Refused(403, outside_message(roots))
    path = _as_written(spelled)
    if path is None or not roots:
        return refused
    written = path.rstrip("/") or "/"
    if not inside(written, [os.path.normpath(os.fspath(r)) for r in roots]):
        return refused  # decided on the text alone: nothing outside is looked at
    real = os.path.realpath(written)
    if not inside(real, [os.path.realpath(r) for r in roots]):
        return refused  # a link inside a root that leads out: the same answer
    if not os.path.exists(real):
        return Refused(404, f"local path {path} does not exist")
    return Allowed(path, real)
