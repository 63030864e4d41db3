"""Engine port choice: pure over the set of ports already held, plus a bind test for strays."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Collection, Sequence
from pathlib import Path


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


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections."""
    try:
        low, high = path.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def overlaps_ephemeral(low: int, high: int, ephemeral: tuple[int, int]) -> bool:
    """Engine ports inside the ephemeral range can be taken by any outgoing connection (even
    the agent's own probe of a booting engine: TCP self-connect), and the engine then cannot
    bind its port until the TIME_WAIT ends."""
    return low <= ephemeral[1] and ephemeral[0] <= high


_IN_USE = re.compile(r"address already in use", re.IGNORECASE)


def lost_its_port(log_tail: Sequence[str], port: int) -> bool:
    """The engine's last lines say it could not bind its own ``port``: another process took
    it between the agent's check and the engine's bind. uvicorn (SGLang, the simulator, which
    bind after loading the model): "[Errno 98] error while attempting to bind on address
    ('h', P): address already in use"; Ollama: "listen tcp h:P: bind: address already in
    use"; vLLM binds its API socket first thing, and its traceback names the function
    (``create_server_socket``) instead of the port. A port other than the engine's own (a
    distributed rendezvous) is the engine's fault, and spends a restart as before."""
    named = re.compile(rf"(?<![0-9]){port}(?![0-9])")
    api_socket = any("create_server_socket" in line for line in log_tail)
    return any(_IN_USE.search(line) and (api_socket or named.search(line)) for line in log_tail)
