"""Engine port choice: pure over the set of ports already held, plus a bind test for strays."""

from __future__ import annotations

import socket
from collections.abc import Callable, Collection


def port_is_free(port: int, host: str = "0.0.0.0") -> bool:
    """True when nothing on this host listens on ``port`` (a quick bind test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(
    low: int,
    high: int,
    held: Collection[int],
    is_free: Callable[[int], bool] = port_is_free,
) -> int | None:
    """The lowest port in [low, high] that no engine holds and nothing else listens on."""
    for port in range(low, high + 1):
        if port not in held and is_free(port):
            return port
    return None
