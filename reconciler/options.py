"""The options of ``serve`` that belong to the reconciler, and the door's settings from them.

Why a module of its own: ``runtime-agent serve`` builds its parser with these options on every
start, and a plain ``serve`` (no ``--claims``) runs no reconciler and no door. Here they cost
argparse and a frozen dataclass; in ``reconciler.cli`` they cost the whole reconciler (its
app, its door, its models), about a fifth of the agent's start-up (issue 26).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from contract.endpoints import RECONCILER_PORT
from reconciler.door.settings import DEFAULT_DOOR_PORT, DoorSettings


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """``serve --claims DIR [--claims-port P] [--door-port P | --no-door] [door options]``:
    reconcile DIR with this agent as the pool, with the front door on by default."""
    parser.add_argument("--claims", help="run the ModelClaim reconciler for this directory "
                        "beside the agent, with the agent as its pool (default: none)")
    parser.add_argument("--claims-port", type=int, default=RECONCILER_PORT,
                        help="port of the embedded reconciler's API (default %(default)s)")
    door_options(parser, DEFAULT_DOOR_PORT)
    parser.add_argument("--no-door", action="store_true",
                        help="no front door beside the embedded reconciler (engines then "
                        "listen on 0.0.0.0 unless --engine-host says otherwise)")


def door_options(parser: argparse.ArgumentParser, port: int | None) -> None:
    on = "on by default with --claims" if port is not None else \
        "off unless a port is given; with --kubernetes every replica listens, the leader answers"
    parser.add_argument("--door-port", type=int, default=port,
                        help=f"port of the OpenAI-compatible front door ({on}; 0: any free "
                        "port; default %(default)s)")
    parser.add_argument("--door-api-keys", default=None, metavar="FILE",
                        help="API keys for the door, one per line, each optionally followed "
                        "by the models it may use (re-read when it changes; default: none, "
                        "the door is open)")
    parser.add_argument("--door-max-held", type=int, default=DoorSettings.max_held,
                        help="requests held per model for a wake, room or a start; more: 503 "
                        "(default %(default)s)")
    parser.add_argument("--door-max-wait", type=float, default=DoorSettings.max_wait_s,
                        help="seconds a request is held at most before a 503 "
                        "(default %(default)s)")
    parser.add_argument("--door-upstream-timeout", type=float,
                        default=DoorSettings.upstream_timeout_s, metavar="SECONDS",
                        help="an engine that sends nothing this long while it owes an answer "
                        "(a non-streamed one is silent until it is done) is given up: 504 "
                        "(default %(default)s)")
    parser.add_argument("--door-allow-release", action="store_true",
                        help="serve POST /v1/models/MODEL/release: a caller whose API key may "
                        "use MODEL asks the pool to put it to sleep now (default: off, 404)")
    parser.add_argument("--door-access-log", default="-", metavar="-|off|FILE",
                        help="the door's JSON access log: stderr (-), off, or a file "
                        "(default %(default)s)")
    parser.add_argument("--door-max-connections", type=int, default=DoorSettings.max_connections,
                        help="connections the door holds at most (and never more than a quarter "
                        "of the open-files soft limit); more are answered 503 and closed "
                        "(default %(default)s)")
    parser.add_argument("--door-max-connections-per-client", type=int, default=0, metavar="N",
                        help="connections one client address may hold (0: half the cap; behind "
                        "a proxy, set it to the cap; default %(default)s)")
    parser.add_argument("--door-head-timeout", type=float, default=DoorSettings.head_timeout_s,
                        help="seconds a request head may take, whole (408 and close after; "
                        "default %(default)s)")
    parser.add_argument("--door-body-timeout", type=float, default=DoorSettings.body_timeout_s,
                        help="seconds a request body may take after its head (408 and close "
                        "after; default %(default)s)")


def door_settings(args: argparse.Namespace, host: str) -> DoorSettings | None:
    """The door's settings from the command line; None when it is off."""
    if getattr(args, "no_door", False) or args.door_port is None:
        return None
    if args.door_max_held < 1 or args.door_max_wait <= 0 or args.door_upstream_timeout <= 0:
        raise SystemExit("--door-max-held must be at least 1, --door-max-wait and "
                         "--door-upstream-timeout positive")
    if args.door_max_connections < 1 or args.door_max_connections_per_client < 0 \
            or args.door_head_timeout <= 0 or args.door_body_timeout <= 0:
        raise SystemExit("--door-max-connections must be at least 1, "
                         "--door-max-connections-per-client 0 or more, and the door's "
                         "timeouts positive")
    return DoorSettings(host=host, port=args.door_port, max_held=args.door_max_held,
                        max_wait_s=args.door_max_wait,
                        upstream_timeout_s=args.door_upstream_timeout,
                        api_keys=Path(args.door_api_keys) if args.door_api_keys else None,
                        access_log=args.door_access_log,
                        allow_release=args.door_allow_release,
                        max_connections=args.door_max_connections,
                        max_connections_per_client=args.door_max_connections_per_client,
                        head_timeout_s=args.door_head_timeout,
                        body_timeout_s=args.door_body_timeout)
