"""``runtime-agent download URL`` (with a progress bar) and ``runtime-agent artifacts`` (a table).

Both talk to a running agent's API; neither touches the cache directory itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any, TextIO

from agent_client import HttpAgentClient, ok_body
from contract.quantity import gib
from runtime_agent.console.commands import add_agent_options, guarded
from runtime_agent.console.output import add_output_flag, columns, render

BAR = 30
POLL_S = 0.5


def add_commands(sub: Any) -> None:
    d = sub.add_parser("download", help="stage an artifact in the agent's weight cache",
                       description="Stage an artifact in the agent's weight cache and draw its "
                       "progress until it is ready (exit 0) or failed (exit 1).")
    d.add_argument("artifact", help="huggingface://ORG/NAME, s3://BUCKET/PREFIX or file:///PATH")
    d.add_argument("--revision", help="Hub branch, tag or commit (default main)")
    d.add_argument("--credential", action="append", default=[], metavar="KEY=VALUE",
                   help="e.g. HF_TOKEN=..., AWS_ACCESS_KEY_ID=... (repeatable)")
    d.add_argument("--no-wait", action="store_true", help="start it and return")
    add_agent_options(d)
    d.set_defaults(func=_download)
    a = sub.add_parser("artifacts", help="list the agent's weight cache")
    add_output_flag(a, ("table", "json", "yaml"))
    a.add_argument("--delete", metavar="ARTIFACT_ID", help="free this entry")
    add_agent_options(a)
    a.set_defaults(func=_artifacts)


def _download(args: argparse.Namespace) -> int:
    creds = dict(item.partition("=")[::2] for item in args.credential)

    async def body(client: HttpAgentClient) -> int:
        entry = ok_body(await client.download(args.artifact, args.revision, creds))
        if args.no_wait:
            print(json.dumps(entry, indent=2))
            return 0
        return await follow(client, entry["artifact_id"], sys.stderr)

    return guarded(args, body)


async def follow(client: HttpAgentClient, artifact_id: str, out: TextIO) -> int:
    """Draw the entry's progress until it is ready (0) or failed (1)."""
    tty = out.isatty()
    while True:
        entries = ok_body(await client.artifacts())["data"]
        entry = next((e for e in entries if e["artifact_id"] == artifact_id), None)
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
        await asyncio.sleep(POLL_S)


def progress_line(entry: dict[str, Any]) -> str:
    done, total = entry["bytes_done"] or 0, entry["bytes_total"] or 0
    share = done / total if total else 0.0
    bar = "#" * int(share * BAR) + "-" * (BAR - int(share * BAR))
    rate = entry.get("rate_bytes_per_second")
    eta = entry.get("eta_seconds")
    parts = [f"[{bar}] {share * 100:5.1f}%", f"{gib(done)} / {gib(total)}"]
    if rate is not None:
        parts.append(f"{gib(rate)}/s")
    if eta is not None:
        parts.append(f"ETA {eta}s")
    parts.append(entry["state"])
    return "  ".join(parts)


def _artifacts(args: argparse.Namespace) -> int:
    async def body(client: HttpAgentClient) -> int:
        if args.delete:
            print(json.dumps(ok_body(await client.delete_artifact(args.delete)), indent=2))
            return 0
        entries = list(ok_body(await client.artifacts())["data"])
        print(render(entries, args.output, lambda entries, _: table(entries)))
        return 0

    return guarded(args, body)


def table(entries: list[dict[str, Any]]) -> str:
    cols = ("ARTIFACT ID", "URL", "REVISION", "STATE", "SIZE", "DONE", "IN USE", "LAST USED",
            "ERROR")
    rows = [cols]
    for e in entries:
        used = e.get("last_used_at")
        rows.append((e["artifact_id"], e["artifact_url"], str(e.get("resolved_revision")
                                                            or e.get("revision") or "-")[:12],
                     e["state"], gib(e["bytes_total"] or 0),
                     f"{100 * (e['bytes_done'] or 0) / (e['bytes_total'] or 1):.0f}%",
                     "yes" if e["in_use"] else "no",
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(used)) if used else "-",
                     (e.get("error") or "")[:60]))
    return columns(rows)
