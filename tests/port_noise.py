"""Port noise: another process on the machine that keeps taking and giving back ports.

A test that picks a free port and then starts a daemon on it assumes nobody else binds that
port in between; on a busy machine someone does, and the test errors at setup ("exited with
5: ... already in use"). Run the suite beside this to find such tests, and to show a fix holds:

    python -m tests.port_noise --seconds 600 &   # then run pytest as usual

It listens on random ports of the kernel's ephemeral range (where ``bind(("", 0))`` picks) and
of 20000-20999 (the agent's default engine ports), on every address, holds each for a few
milliseconds and closes it, ``--rate`` times a second, with at most ``--held`` open at once.
A port in use is skipped. It stops after ``--seconds``, or at SIGTERM / SIGINT, and prints how
many ports it took.
"""

from __future__ import annotations

import argparse
import heapq
import random
import signal
import socket
import sys
import time
from collections.abc import Sequence
from types import FrameType

from runtime_agent.supervision.ports import ephemeral_range

ENGINE_PORTS = (20000, 20999)


def pick(rng: random.Random, ranges: Sequence[tuple[int, int]]) -> int:
    """A port from ``ranges``, each port as likely as any other."""
    sizes = [high - low + 1 for low, high in ranges]
    offset = rng.randrange(sum(sizes))
    for (low, _), size in zip(ranges, sizes):
        if offset < size:
            return low + offset
        offset -= size
    raise AssertionError("unreachable")


def take(port: int, host: str) -> socket.socket | None:
    """A socket listening on ``port``, or None when someone holds it already."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(1)
    except OSError:
        sock.close()
        return None
    return sock


def run(seconds: float, rate: float, hold_s: tuple[float, float], held_max: int,
        ranges: Sequence[tuple[int, int]], host: str = "0.0.0.0", seed: int | None = None) -> int:
    """Make noise for ``seconds``; the number of ports taken."""
    rng = random.Random(seed)
    held: list[tuple[float, int, socket.socket]] = []  # a heap: the next to close first
    stop = False

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    taken = 0
    start = time.monotonic()
    end = start + seconds
    try:
        while not stop and (now := time.monotonic()) < end:
            while held and (held[0][0] <= now or len(held) >= held_max):
                heapq.heappop(held)[2].close()
            sock = take(pick(rng, ranges), host)
            if sock is not None:
                taken += 1
                heapq.heappush(held, (now + rng.uniform(*hold_s), sock.fileno(), sock))
            time.sleep(max(0.0, start + taken / rate - time.monotonic()) if rate else 0.0)
    finally:
        for _, _, sock in held:
            sock.close()
    return taken


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.port_noise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, required=True, help="how long to make noise")
    parser.add_argument("--rate", type=float, default=500.0, help="ports taken per second")
    parser.add_argument("--hold-ms", type=float, nargs=2, default=(5.0, 200.0),
                        metavar=("MIN", "MAX"), help="how long each port is held")
    parser.add_argument("--held", type=int, default=256, help="most ports held at once")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    ranges = [ephemeral_range(), ENGINE_PORTS]
    taken = run(args.seconds, args.rate, (args.hold_ms[0] / 1000, args.hold_ms[1] / 1000),
                args.held, ranges, args.host, args.seed)
    print(f"port noise: took {taken} ports in {args.seconds:g} s over "
          f"{', '.join(f'{low}-{high}' for low, high in ranges)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
