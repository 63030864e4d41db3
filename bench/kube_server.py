"""The API server stand-in (``tests.kube_api.ApiServer``, kmock) as a process of its own, for
the Kubernetes scale bench: ``python -m bench.kube_server --port 18443``. ``GET /stats`` answers
its request counts by verb."""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

import kmock

from tests.kube_api import ApiServer


async def serve(port: int) -> None:
    async with ApiServer(bookmark_interval=5.0, history=50_000) as server, \
            kmock.Server(server, port=port):
        def stats(request: Any) -> dict[str, Any]:
            return {"counts": dict(server.counts), "version": server.version}

        server["get /stats"] << stats
        print(f"kube API stand-in on 127.0.0.1:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--port", type=int, default=18443)
    asyncio.run(serve(p.parse_args().port))


if __name__ == "__main__":
    main()
