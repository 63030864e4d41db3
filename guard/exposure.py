"""Where a server may listen: secure by default.

A server that asks for no token (none configured) listens on loopback only: anyone who reaches
its port could start, stop and wake engines, so only this machine may. Listening on any other
address without a token takes ``--insecure-no-auth``, a flag whose name says what it does (the
AIBrix controller sends no token: docs/aibrix-compat.md); without it the server does not start
(exit 2, one line saying what to do). With a token, the default is every interface, as the
Pod's network needs.

``listen_host`` is the one rule for ``runtime-agent serve`` and ``runtime-agent reconcile``.
"""

from __future__ import annotations

import ipaddress
import socket

INSECURE_FLAG = "--insecure-no-auth"
LOOPBACK = "127.0.0.1"
EVERYWHERE = "0.0.0.0"


class ExposureError(ValueError):
    """A non-loopback address without a token or the insecure flag; ``str()``: one line."""


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback one (an unknown name: False)."""
    if host in ("", EVERYWHERE, "::", "*"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback
                               for info in infos)


def listen_host(host: str | None, has_token: bool, insecure: bool,
                token_hint: str = "--token-file (or RUNTIME_AGENT_TOKEN)") -> str:
    """The address to listen on for ``--host`` (None: not given)."""
    if host is None:
        return EVERYWHERE if has_token or insecure else LOOPBACK
    if has_token or insecure or is_loopback(host):
        return host
    raise ExposureError(
        f"--host {host} without a token would let anyone who reaches it start, stop and wake "
        f"engines; set {token_hint}, or listen on {LOOPBACK}, or say {INSECURE_FLAG} to serve "
        "without a token anyway")


def insecure_warning(server: str, host: str, port: int) -> str:
    """The loud line a server logs when it listens beyond loopback without a token."""
    return (f"INSECURE ({INSECURE_FLAG}): the {server} on {host}:{port} takes every request "
            "without a token; anyone who reaches this address can start, stop and wake "
            "engines. Restrict who can reach it (a NetworkPolicy) or set a token")
