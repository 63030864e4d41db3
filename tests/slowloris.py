"""A slowloris for tests: many half-sent request heads to one loopback port, held for a while.

``python -m tests.slowloris PORT COUNT SECONDS``: opens up to COUNT connections to 127.0.0.1:PORT
(at most 256 connecting at once, each given 2 s), sends each the start of a request head, then
one more header line a second (so that a server whose idle clock every byte re-arms keeps them),
for SECONDS from the start or until SIGTERM. It prints one line ``opened N`` when every
connection has been tried, and at the end one JSON line: what the connections were answered
(``503``, ``408``: the status line's code; ``closed``: closed without an answer; ``held``: still
open at the end; ``failed``: never connected). Loopback only; bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import sys
from collections import Counter

HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n")
CONNECTING = 256


class Attack:
    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.count = count
        self.tried = 0
        self.all_tried = asyncio.Event()
        self.end = asyncio.Event()
        self.gate = asyncio.Semaphore(CONNECTING)
        self.seen: Counter[str] = Counter()

    async def one(self) -> None:
        async with self.gate:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.port), 2.0)
                writer.write(HEAD)
            except (OSError, TimeoutError):
                self.seen["failed"] += 1
                return
            finally:
                self.tried += 1
                if self.tried == self.count:
                    self.all_tried.set()
        first = asyncio.ensure_future(reader.read(64))
        try:
            while not self.end.is_set():
                done, _ = await asyncio.wait({first}, timeout=1.0)
                if done:
                    break
                writer.write(b"X-Slow: 1\r\n")
            self.seen[_outcome(first)] += 1
        finally:
            first.cancel()
            writer.close()


def _outcome(first: asyncio.Future[bytes]) -> str:
    if not first.done():
        return "held"
    if first.cancelled() or first.exception() is not None:
        return "closed"
    data = first.result()
    return data[9:12].decode() if data.startswith(b"HTTP/1.1 ") else "closed"


async def main(port: int, count: int, seconds: float) -> None:
    loop = asyncio.get_running_loop()
    attack = Attack(port, count)
    loop.add_signal_handler(signal.SIGTERM, attack.end.set)
    loop.call_later(seconds, attack.end.set)
    tasks = [asyncio.ensure_future(attack.one()) for _ in range(count)]
    await attack.all_tried.wait()
    print(f"opened {count - attack.seen['failed']}", flush=True)
    await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps(dict(attack.seen)), flush=True)


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
