"""The reconciler's commands, for ``runtime-agent``'s command line.

``add_commands(subparsers)`` adds:

* ``reconcile --claims DIR --pool FILE [--host H] [--port P] [--door-port P]``: run the
  reconciler standalone against the agents the pool file names (with a front door when
  ``--door-port`` is given); ``reconcile --kubernetes [--door-port P]`` against the Kubernetes
  API (the door answers on the leading replica);
* ``claims get [NAME] [--url URL] [-o table|json]``: the guide's table (NAME, PHASE, DESIRED,
  READY, ENGINE, ARTIFACT, AGE) from a reconciler's ``/v1/claims``;
* ``claims describe NAME [-n NAMESPACE] [--url URL]``: a claim's conditions, instance, route and
  events;
* ``claims estimate ARTIFACT [--arg FLAG=VALUE]``: the perGPU figures a model's files give
  (``reconciler.estimating``).

The reconciler the agent's ``serve --claims`` runs beside itself is ``reconciler.local.embedded``;
the options it reads (``--claims DIR``, ``--claims-port``, the front door's) are added to
``serve`` by ``reconciler.options``, which a plain ``serve`` imports without this module.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import urllib.parse
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from contract.endpoints import AGENT_PORT, base_url
from contract.quantity import gib, quantity
from guard.exposure import INSECURE_FLAG, ExposureError, insecure_warning, is_loopback, \
    listen_host
from guard import listen
from guard.tokens import TokenError, TokenSource, token_source
from reconciler.local.app import DEFAULT_PORT, run_reconciler
from agent_client import AgentUnreachable, JsonApi, Refusal, ok_body
from reconciler.door.keys import check_keys_file
from reconciler.door.settings import DoorSettings
from reconciler.estimating import add_estimate
from reconciler.options import add_serve_options, door_options, door_settings

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
EXIT_UNREACHABLE = 8  # as the agent's client commands (README, "Exit codes")
EXIT_DIRECTORY = 4  # a directory it writes cannot be used, as the agent's serve
EXIT_USAGE = 2  # a flag is wrong (a non-loopback --host without a token), as the agent's serve
EXIT_UNREADABLE = 7  # a token file cannot be used, as the agent's serve
EXIT_PORT = 5  # a port cannot be bound (in use, privileged), as the agent's serve
DEFAULT_STATE_DIR = "/var/run/aibrix/reconciler"


def _url_default() -> str:
    return os.environ.get("RECONCILER_URL", DEFAULT_URL)


def _url(text: str) -> str:
    """``--url`` with or without its scheme (``host:8081``, ``:8081``)."""
    try:
        return base_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_URL_HELP = "the reconciler's address (env RECONCILER_URL; default %(default)s)"


def add_commands(sub: Any) -> None:
    """Add ``reconcile`` and ``claims get|describe`` to an argparse subparsers object."""
    r = sub.add_parser("reconcile", help="run the ModelClaim reconciler against a pool of agents")
    r.add_argument("--claims", help="directory of ModelClaim manifests (local mode)")
    r.add_argument("--pool", help="WarmPool manifest naming the agents (may be in --claims)")
    r.add_argument("--kubernetes", action="store_true",
                   help="reconcile ModelClaim custom resources, with pool Pods as agents")
    r.add_argument("--kubeconfig", help="with --kubernetes: a kubeconfig file (default: the "
                   "Pod's service account in a cluster, else $KUBECONFIG or ~/.kube/config)")
    r.add_argument("--context", help="with --kubernetes: the kubeconfig context")
    r.add_argument("--namespace", help="with --kubernetes: watch only this namespace")
    r.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "default"),
                   help="with --kubernetes: namespace of the leader-election Lease")
    r.add_argument("--identity", help="with --kubernetes: this replica's name in the Lease "
                   "(default: $POD_NAME, else host name and pid)")
    r.add_argument("--no-leader-election", action="store_true",
                   help="with --kubernetes: lead at once (one replica only)")
    r.add_argument("--lease-duration", type=float, default=15.0)
    r.add_argument("--renew-deadline", type=float, default=10.0)
    r.add_argument("--retry-period", type=float, default=2.0)
    r.add_argument("--agent-token-file", default=os.environ.get("RUNTIME_AGENT_TOKEN_FILE"),
                   help="file holding the agents' bearer token (a mounted Secret; or set "
                        "RUNTIME_AGENT_TOKEN); sent as Authorization: Bearer on every agent "
                        "call (default: --token-file's)")
    r.add_argument("--token-file", default=os.environ.get("RECONCILER_TOKEN_FILE"),
                   help="file holding this API's bearer token, asked of every call that "
                   "changes something (a wake) (env RECONCILER_TOKEN_FILE, or the token in "
                   "RECONCILER_TOKEN; default: the agents' token, one Secret for both)")
    r.add_argument("--auth-reads", action="store_true",
                   help="reading claims and routes needs the token too (/healthz and /metrics "
                   "stay open)")
    r.add_argument(INSECURE_FLAG, action="store_true",
                   help="let the API listen beyond loopback without a token (anyone who "
                   "reaches it can wake models); default address with it: every interface")
    r.add_argument("--state-dir", default=os.environ.get("RECONCILER_STATE_DIR",
                                                        DEFAULT_STATE_DIR),
                   help="local mode: where claim statuses are kept, outside the manifests "
                   "(env RECONCILER_STATE_DIR; default %(default)s)")
    r.add_argument("--host", default=None,
                   help="address of the API and the door (default: 127.0.0.1 without a "
                   f"token, every interface with one; another without a token needs "
                   f"{INSECURE_FLAG})")
    r.add_argument("--port", type=int, default=DEFAULT_PORT)
    r.add_argument("--log-level", default="info")
    door_options(r, None)
    r.set_defaults(func=_reconcile)
    c = sub.add_parser("claims", help="show ModelClaims of a reconciler")
    csub = c.add_subparsers(dest="claims_command", required=True)
    g = csub.add_parser("get", help="the claims as a table")
    g.add_argument("name", nargs="?")
    g.add_argument("-n", "--namespace")
    g.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    g.add_argument("-w", "--watch", action="store_true",
                   help="after the table, print a claim's row again each time it changes "
                   "(as kubectl get -w; Ctrl-C ends it)")
    g.add_argument("--url", type=_url, default=_url_default(), help=_URL_HELP)
    _client_token_option(g)
    g.set_defaults(func=_claims)
    k = csub.add_parser("check", help="check manifests without applying them (as "
                        "kubectl apply --dry-run)",
                        description="Parse FILEs and DIRs (their *.yaml, *.yml) with the "
                        "reconciler's own code and print each problem as it would; nothing is "
                        "started or sent. Exit 0: valid; 1: problems; 7: a path cannot be read.")
    k.add_argument("paths", nargs="+", metavar="FILE|DIR")
    k.set_defaults(func=_check)
    d = csub.add_parser("describe", help="one claim's conditions and events")
    d.add_argument("name")
    d.add_argument("-n", "--namespace", default="default")
    d.add_argument("--url", type=_url, default=_url_default(), help=_URL_HELP)
    _client_token_option(d)
    d.set_defaults(func=_claims)
    add_estimate(csub)  # claims estimate ARTIFACT [--arg FLAG=VALUE]: perGPU from the files


def _client_token_option(parser: argparse.ArgumentParser) -> None:
    env = os.environ
    parser.add_argument("--token-file", default=env.get("RECONCILER_TOKEN_FILE")
                        or env.get("RUNTIME_AGENT_TOKEN_FILE"),
                        help="a file holding the reconciler's bearer token, sent with each "
                        "call (env RECONCILER_TOKEN_FILE or RUNTIME_AGENT_TOKEN_FILE; or the "
                        "token in RECONCILER_TOKEN or RUNTIME_AGENT_TOKEN)")


def check_ports(host: str, port: int, door: DoorSettings | None) -> None:
    """The reconciler's port and its door's: distinct and free now, or a ``PortError``
    naming the flag, before anything starts (each server binds its own port later)."""
    listen.distinct({"--port": port, "--door-port": door.port if door else None})
    if port != 0:
        listen.check_free(host, port, "--port")
    if door is not None and door.port != 0:
        listen.check_free(door.host, door.port, "--door-port")


def checked_door_settings(args: argparse.Namespace, host: str) -> DoorSettings | None:
    """``door_settings``, with its keys file read now, before anything listens: a broken one
    is a ``KeysError`` (one line to print)."""
    door = door_settings(args, host)
    if door is not None and door.api_keys is not None:
        check_keys_file(door.api_keys)
    return door


def _sources(args: argparse.Namespace) -> tuple[TokenSource | None, TokenSource | None]:
    """(this API's token, the agents' token): each from its file or variable, the other's
    when not given (one Secret for the pool and its controller); a ``TokenError`` for a file
    that cannot be used."""
    env = os.environ
    agents = token_source(args.agent_token_file, env.get("RUNTIME_AGENT_TOKEN"),
                          "--agent-token-file")
    if args.token_file and args.token_file == args.agent_token_file:
        return agents, agents
    own = token_source(args.token_file, env.get("RECONCILER_TOKEN"), "--token-file",
                       "RECONCILER_TOKEN")
    return own or agents, agents or own


def _reconcile(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        api_token, token = _sources(args)
        host = listen_host(args.host, api_token is not None, args.insecure_no_auth,
                           "--token-file (or RECONCILER_TOKEN)")
        door = checked_door_settings(args, host)
        check_ports(host, args.port, door)
    except (TokenError, ExposureError, listen.PortError) as exc:
        print(f"runtime-agent reconcile: {exc}", file=sys.stderr)
        if isinstance(exc, listen.PortError):
            return EXIT_USAGE if exc.usage else EXIT_PORT
        return EXIT_UNREADABLE if isinstance(exc, TokenError) else EXIT_USAGE
    if api_token is None and not is_loopback(host):
        logging.getLogger("reconciler.cli").warning(
            insecure_warning("reconciler API", host, args.port))
    if args.kubernetes:
        if args.claims or args.pool:
            raise SystemExit("--kubernetes reads claims and pools from the API server; "
                             "leave out --claims and --pool")
        from reconciler.core import CoreSettings
        from reconciler.kube.app import KubeSettings, run_kubernetes
        identity = args.identity or os.environ.get("POD_NAME") or KubeSettings().identity
        settings = KubeSettings(
            CoreSettings(host=host, port=args.port, resync_interval=1800.0,
                         feed_wait=55, kv_workers=16, agent_token=token, api_token=api_token,
                         auth_reads=args.auth_reads),
            kubeconfig=args.kubeconfig, context=args.context, namespace=args.namespace,
            lease_namespace=args.lease_namespace, leader_election=not args.no_leader_election,
            lease_duration=args.lease_duration, renew_deadline=args.renew_deadline,
            retry_period=args.retry_period, identity=identity, door=door)
        return run_kubernetes(settings)
    if not args.claims:
        raise SystemExit("reconcile needs --claims DIR (local mode) or --kubernetes")
    status_dir = Path(args.state_dir) / "claims-status"
    try:
        status_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"runtime-agent reconcile: cannot use --state-dir {args.state_dir}: "
              f"{exc.strerror}; choose a directory you can write (--state-dir or "
              "RECONCILER_STATE_DIR)", file=sys.stderr)
        return EXIT_DIRECTORY
    run_reconciler(args.claims, args.pool, host, args.port, agent_token=token,
                   door=door, status_dir=status_dir,
                   api_token=api_token, auth_reads=args.auth_reads)
    return 0


async def _get(api: JsonApi, path: str) -> dict[str, Any]:
    return dict(ok_body(await api.request("GET", path)))


def _check(args: argparse.Namespace) -> int:
    from reconciler.local.check import check

    lines, code = check(args.paths)
    for line in lines:
        print(line, file=sys.stderr if code else sys.stdout)
    return code


def _claims(args: argparse.Namespace) -> int:
    return asyncio.run(_claims_from(args))


async def _claims_from(args: argparse.Namespace) -> int:
    """``claims get`` and ``claims describe``, on the client the reconciler uses for agents."""
    env = os.environ
    try:
        source = token_source(args.token_file, env.get("RECONCILER_TOKEN")
                              or env.get("RUNTIME_AGENT_TOKEN"))
    except TokenError as exc:
        print(f"runtime-agent claims: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    async with aiohttp.ClientSession() as session:
        api = JsonApi(args.url, session, token=source.token() if source else None)
        try:
            return await _show_claims(api, args)
        except Refusal as exc:
            status = exc.reply.status
            print(f"error ({status}): {exc.reply.message}{await _pointer(api, status)}",
                  file=sys.stderr)
            return 1
        except AgentUnreachable as exc:
            print(f"cannot reach the reconciler ({exc}); is it running (runtime-agent serve "
                  "--claims DIR, or reconcile)? Set --url or RECONCILER_URL", file=sys.stderr)
            return EXIT_UNREACHABLE


async def _show_claims(api: JsonApi, args: argparse.Namespace) -> int:
    if args.claims_command == "describe":
        path = f"/v1/claims/{urllib.parse.quote(args.namespace)}/{urllib.parse.quote(args.name)}"
        try:
            print(describe(await _get(api, path)))
            return 0
        except Refusal as exc:
            invalid = _problems(await _get(api, "/v1/claims"), args.name, args.namespace)
            if exc.reply.status != 404 or not invalid:
                raise
            print(f"{args.namespace}/{args.name} is not running: its manifest is invalid")
            for line in invalid:
                print(f"  {line}")
            return 1
    listing = await _get(api, "/v1/claims")
    items = _selected(listing, args)
    if args.watch:
        return await _watch(api, args, items)
    if args.output == "json":
        print(json.dumps(items, indent=2))
    elif args.output == "yaml":
        import yaml  # type: ignore[import-untyped]

        print(yaml.safe_dump(items, sort_keys=False).rstrip("\n"))
    else:
        print(table(items))
        for line in spec_warnings(items):
            print(line)
        running = {(i["metadata"]["namespace"], i["metadata"]["name"]) for i in items}
        invalid = _problems(listing, args.name, args.namespace, running)
        if invalid:
            print("invalid manifests (not running; fix the file, or see `claims describe NAME`):")
            for line in invalid:
                print(f"  {line}")
    return 0


def _problems(listing: dict[str, Any], name: str | None, namespace: str | None,
              running: set[tuple[str, str]] | None = None) -> list[str]:
    """The reconciler's problems with declared objects that have no claim running (those that
    do say it in their SpecApplied condition), as lines; one object's with ``name``."""
    out = []
    for p in listing.get("problems") or ():
        if running and (p.get("namespace") or "default", p.get("name")) in running:
            continue
        if name is not None and p.get("name") != name:
            continue
        if namespace is not None and p.get("namespace") not in ("", None, namespace):
            continue
        where = f"{p['namespace']}/{p['name']}" if p.get("namespace") else p.get("name", "")
        source = f" ({p['source']})" if p.get("source") else ""
        out.append(f"{p.get('kind', '')} {where}{source}: {p.get('reason')}: {p.get('message')}")
    return out


def spec_warnings(items: list[dict[str, Any]]) -> list[str]:
    """One line per claim whose declared spec is not the one running (``SpecApplied``)."""
    out = []
    for i in items:
        for c in i["status"].get("conditions") or ():
            if c["type"] == "SpecApplied" and c["status"] == "False":
                out.append(f"warning: {i['metadata']['name']}: {c['reason']}: {c['message']}")
    return out


async def _pointer(api: JsonApi, status: int) -> str:
    """A 404 from a runtime agent's port: say where the reconciler is."""
    if status != 404:
        return ""
    try:
        health = await api.request("GET", "/healthz")
    except AgentUnreachable:
        return ""
    if "boot_id" in health.body:  # only the agent's /healthz has it
        return (f" — {api.url} is a runtime agent (port {AGENT_PORT} by default), not the "
                f"reconciler; claims are served by the reconciler: --url {DEFAULT_URL} (or "
                "RECONCILER_URL)")
    return ""


def age(stamp: str | None, now: float | None = None) -> str:
    """kubectl's AGE: 45s, 3m, 2h, 5d."""
    if not stamp:
        return "<unknown>"
    seconds = (now if now is not None else time.time()) - datetime.fromisoformat(
        stamp.replace("Z", "+00:00")).timestamp()
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _columns(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


HEADER = ("NAME", "PHASE", "DESIRED", "READY", "ENGINE", "ARTIFACT", "AGE")
WATCH_S = 1.0  # claims get -w: how often the list is read again


def row(item: dict[str, Any], now: float | None = None) -> tuple[str, ...]:
    meta, spec, st = item["metadata"], item["spec"], item["status"]
    return (meta["name"], st["phase"], str(st.get("desiredReplicas", 1)),
            str(st.get("readyReplicas", 0)), spec.get("engine", ""), spec.get("artifactURL", ""),
            age(meta.get("creationTimestamp"), now))


def table(items: list[dict[str, Any]], now: float | None = None) -> str:
    """The guide's ``kubectl get modelclaims`` table."""
    if not items:
        return "No claims found."
    return _columns([HEADER, *(row(i, now) for i in items)])


def _selected(listing: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    return [i for i in listing["items"]
            if (args.name is None or i["metadata"]["name"] == args.name)
            and (args.namespace is None or i["metadata"]["namespace"] == args.namespace)]


async def _watch(api: JsonApi, args: argparse.Namespace, items: list[dict[str, Any]]) -> int:
    """``claims get -w``, as ``kubectl get -w``: the table, then a row each time a claim's
    phase, replicas, engine or artifact changes (and ``<deleted>`` when it goes), until
    Ctrl-C."""
    widths = [max(len(c) for c in col) for col in zip(HEADER, *(row(i) for i in items))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()

    seen = {(i["metadata"]["namespace"], i["metadata"]["name"]): row(i)[:-1] for i in items}
    print(line(HEADER))
    for i in items:
        print(line(row(i)), flush=True)
    try:
        while True:
            await asyncio.sleep(WATCH_S)
            now = {(i["metadata"]["namespace"], i["metadata"]["name"]): i
                   for i in _selected(await _get(api, "/v1/claims"), args)}
            for key, item in now.items():
                if seen.get(key) != row(item)[:-1]:
                    seen[key] = row(item)[:-1]
                    print(line(row(item)), flush=True)
            for key in seen.keys() - now.keys():
                print(line((key[1], "<deleted>")), flush=True)
                del seen[key]
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0


def _quantity(value: Any) -> str:
    """A size as the manifest would write it (``6Gi``); ``-`` when not declared."""
    return quantity(value) if isinstance(value, int) else "-" if value is None else str(value)


def describe(doc: dict[str, Any], now: float | None = None) -> str:
    meta, spec, st = doc["metadata"], doc["spec"], doc["status"]
    lines = [f"Name:         {meta['name']}", f"Namespace:    {meta['namespace']}",
             f"UID:          {meta.get('uid', '')}",
             f"Created:      {meta.get('creationTimestamp')} "
             f"({age(meta.get('creationTimestamp'), now)} ago)"]
    if meta.get("deletionTimestamp"):
        lines.append(f"Deleted:      {meta['deletionTimestamp']} (stopping its engine)")
    per_gpu = spec.get("perGPU") or {}
    lines += [f"Model:        {spec.get('modelName')}", f"Engine:       {spec.get('engine')}",
              f"Artifact:     {spec.get('artifactURL')}",
              f"Per GPU:      maximumFootprint {_quantity(per_gpu.get('maximumFootprint'))}, "
              f"kvFloor {_quantity(per_gpu.get('kvFloor'))}",
              f"Phase:        {st['phase']}"]
    if int(st.get("desiredReplicas") or 1) > 1:
        lines.append(f"Replicas:     {st.get('readyReplicas', 0)} ready of "
                     f"{st['desiredReplicas']}")
    for inst in st.get("instances") or ():
        kv = inst.get("kvLimitBytes")
        kv_text = gib(kv) if isinstance(kv, int) else "not set"
        which = f"replica {inst['index']} ({inst.get('phase')}) " if "index" in inst else ""
        lines.append(f"Instance:     {which}{inst['agent']} port {inst.get('port')} GPU "
                     f"{','.join(str(d) for d in inst.get('devices') or ()) or '-'}, "
                     f"KV limit {kv_text}")
    route = doc.get("route")
    if route:
        where = f"{route['host']}:{route['port']}" if route.get("port") else "no port"
        lines.append(f"Route:        {route['state']} {where}"
                     + (f" ({route['reason']})" if route.get("reason") else ""))
    lines.append("Conditions:")
    rows: list[tuple[str, ...]] = [("  Type", "Status", "Reason", "Age", "Message")]
    rows += [(f"  {c['type']}", c["status"], c["reason"], age(c.get("lastTransitionTime"), now),
              c.get("message", "")) for c in st.get("conditions") or ()]
    lines.append(_columns(rows))
    lines.append("Events:")
    events = doc.get("events") or []
    if not events:
        lines.append("  <none>")
    else:
        rows = [("  Type", "Reason", "Age", "Message")]
        for e in events:
            count = f" (x{e['count']})" if e.get("count", 1) > 1 else ""
            rows.append((f"  {e['type']}", e["reason"], age(e.get("lastTimestamp"), now) + count,
                         e["message"]))
        lines.append(_columns(rows))
    return "\n".join(lines)
