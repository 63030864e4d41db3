"""``runtime-agent download URL`` (with a progress bar) and ``runtime-agent artifacts`` (a table).

Both talk to a running agent's API; neither touches the cache directory itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO

from runtime_agent.artifacts.planning import human
from runtime_agent.client import AgentClient, AgentError, read_token

BAR = 30
POLL_S = 0.5


def add_commands(sub: Any) -> None:
    url = os.environ.get("RUNTIME_AGENT_URL", "http://127.0.0.1:8080")
    d = sub.add_parser("download", help="stage an artifact in the agent's weight cache")
    d.add_argument("artifact", help="huggingface://ORG/NAME, s3://BUCKET/PREFIX or file:///PATH")
    d.add_argument("--revision", help="Hub branch, tag or commit (default main)")
    d.add_argument("--credential", action="append", default=[], metavar="KEY=VALUE",
                   help="e.g. HF_TOKEN=..., AWS_ACCESS_KEY_ID=... (repeatable)")
    d.add_argument("--no-wait", action="store_true", help="start it and return")
    d.add_argument("--url", default=url)
    d.add_argument("--token-file", default=os.environ.get("RUNTIME_AGENT_TOKEN_FILE"))
    d.set_defaults(func=_download)
    a = sub.add_parser("artifacts", help="list the agent's weight cache")
    a.add_argument("-o", "--output", choices=("table", "json"), default="table")
    a.add_argument("--delete", metavar="ARTIFACT_ID", help="free this entry")
    a.add_argument("--url", default=url)
    a.add_argument("--token-file", default=os.environ.get("RUNTIME_AGENT_TOKEN_FILE"))
    a.set_defaults(func=_artifacts)


def _run(args: argparse.Namespace, body: Any) -> int:
    try:
        return int(body(AgentClient(args.url, token=read_token(args.token_file))))
    except AgentError as exc:
        print(f"error ({exc.status}): {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"cannot reach the agent at {args.url}: {exc}", file=sys.stderr)
        return 2


def _download(args: argparse.Namespace) -> int:
    creds = dict(item.partition("=")[::2] for item in args.credential)

    def body(client: AgentClient) -> int:
        entry = client.download(args.artifact, args.revision, creds)
        if args.no_wait:
            print(json.dumps(entry, indent=2))
            return 0
        return follow(client, entry["artifact_id"], sys.stderr)

    return _run(args, body)


def follow(client: AgentClient, artifact_id: str, out: TextIO) -> int:
    """Draw the entry's progress until it is ready (0) or failed (1)."""
    tty = out.isatty()
    while True:
        entry = next((e for e in client.artifacts() if e["artifact_id"] == artifact_id), None)
        if entry is None:
            print(f"\nentry {artifact_id} is gone (deleted?)", file=out)
            return 1
        if tty or entry["state"] != "downloading":
            out.write(("\r" if tty else "") + progress_line(entry) + ("" if tty else "\n"))
            out.flush()
        if entry["state"] == "ready":
            print(("\n" if tty else "") + entry["local_path"])
            return 0
        if entry["state"] == "failed":
            print(("\n" if tty else "") + f"failed: {entry['error']}", file=out)
            return 1
        time.sleep(POLL_S)


def progress_line(entry: dict[str, Any]) -> str:
    done, total = entry["bytes_done"] or 0, entry["bytes_total"] or 0
    share = done / total if total else 0.0
    bar = "#" * int(share * BAR) + "-" * (BAR - int(share * BAR))
    rate = entry.get("rate_bytes_per_second")
    eta = entry.get("eta_seconds")
    parts = [f"[{bar}] {share * 100:5.1f}%", f"{human(done)} / {human(total)}"]
    if rate is not None:
        parts.append(f"{human(rate)}/s")
    if eta is not None:
        parts.append(f"ETA {eta}s")
    parts.append(entry["state"])
    return "  ".join(parts)


def _artifacts(args: argparse.Namespace) -> int:
    def body(client: AgentClient) -> int:
        if args.delete:
            print(json.dumps(client.delete_artifact(args.delete), indent=2))
            return 0
        entries = client.artifacts()
        print(json.dumps(entries, indent=2) if args.output == "json" else table(entries))
        return 0

    return _run(args, body)


def table(entries: list[dict[str, Any]]) -> str:
    cols = ("ARTIFACT ID", "URL", "REVISION", "STATE", "SIZE", "DONE", "IN USE", "LAST USED",
            "ERROR")
    rows = [cols]
    for e in entries:
        used = e.get("last_used_at")
        rows.append((e["artifact_id"], e["artifact_url"], str(e.get("resolved_revision")
                                                            or e.get("revision") or "-")[:12],
                     e["state"], human(e["bytes_total"] or 0),
                     f"{100 * (e['bytes_done'] or 0) / (e['bytes_total'] or 1):.0f}%",
                     "yes" if e["in_use"] else "no",
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(used)) if used else "-",
                     (e.get("error") or "")[:60]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)
