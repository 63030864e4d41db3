"""Binding the ports a server will listen on, before anything starts, each refusal one line.

``runtime-agent serve`` and ``runtime-agent reconcile`` listen on up to four ports (the agent's
API, its probe port, the reconciler's API, the front door). Each is bound here at start-up, so a
port that is taken, privileged or not of this machine stops the process before it has started
anything, with a line that names the flag to change; the bound sockets are handed to the server
that will listen on them, or closed when that server binds its own (``check_free``).
"""

from __future__ import annotations

import errno
import socket


class PortError(ValueError):
    """A port that cannot be bound; ``str()``: one line naming the flag; ``usage``: the value is
    not a port at all (a usage mistake rather than a machine's state)."""

    def __init__(self, message: str, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


def bind(host: str, port: int, flag: str) -> list[socket.socket]:
    """Bound (not yet listening) sockets for every address ``host`` names, as aiohttp's
    TCPSite would bind them; raises PortError naming what to fix."""
    if not 1 <= port <= 65535:
        raise PortError(f"{flag} {port} is not a port (1-65535)", usage=True)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortError(f"--host {host!r} is not an address of this machine "
                        f"({exc.strerror})") from None
    bound: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.set_inheritable(False)
    except OSError as exc:
        for sock in bound:
            sock.close()
        raise PortError(port_message(exc, host, port, flag)) from None
    return bound


def check_free(host: str, port: int, flag: str) -> None:
    """Raise PortError unless ``port`` can be bound now (for a server that binds its own)."""
    for sock in bind(host, port, flag):
        sock.close()


def distinct(ports: dict[str, int | None]) -> None:
    """Raise PortError when two flags name the same port (``{flag: port}``; None: not used)."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port is None or port == 0:  # 0: any free port, never a clash
            continue
        if port in seen:
            raise PortError(f"{flag} {port} is the {seen[port]} port too; servers need a port "
                            f"of their own: pick another port for {flag}")
        seen[port] = flag


def port_message(exc: OSError, host: str, port: int, flag: str) -> str:
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (f"{flag} {port}: {where} is already in use (another agent? `ss -ltnp "
                f"'sport = :{port}'` shows who); stop it or pick another {flag}")
    if exc.errno == errno.EACCES:
        return f"{flag} {port}: binding {where} is not allowed (ports below 1024 need root)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host!r} is not an address of this machine"
    return f"{flag} {port}: cannot bind {where}: {exc.strerror or exc}"
