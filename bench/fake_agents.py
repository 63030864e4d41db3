"""A fleet of lightweight runtime-agent stand-ins in one process, for the reconciler's scale bench.

Each agent listens on its own loopback address (``127.0.X.Y``, one port for all), so a pool Pod's
``podIP`` and ``runtime`` port reach exactly one agent, as in a cluster. Each speaks the part of
the agent's HTTP API the reconciler uses (``README.md``, "The API"): ``GET
/v1/runtime/snapshot`` (with an ETag; ``If-None-Match`` answers 304), ``POST
/v1/runtime/models/{activate,deactivate,sleep,wake,kv-limit}`` and the ``GET
/v1/runtime/events?since=N&wait=S`` long-poll. An activated engine is active at once (no process),
so what the bench measures is the reconciler, not engine start-up.

A control API on ``127.0.0.1:<control>`` reports what happened: ``GET /activations`` gives the
wall time of every activate call by model, ``GET /stats`` counts the calls by kind.

    python -m bench.fake_agents --count 1000 --port 18080 --control 18079
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import resource
import signal
import time
from collections import Counter
from typing import Any

from aiohttp import web

from contract.quantity import GiB


def agent_ip(index: int) -> str:
    """The loopback address of agent ``index`` (0-based): 127.0.1.1, 127.0.1.2, ..."""
    return f"127.0.{1 + index // 250}.{1 + index % 250}"


class FakeAgent:
    def __init__(self, name: str, gpus: int, card: int) -> None:
        self.name = name
        self.gpus = gpus
        self.card = card
        self.models: dict[str, dict[str, Any]] = {}
        self.seq = 0
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.version = 0
        self._body: bytes | None = None

    def touch(self, model: str, src: str, dst: str, reason: str) -> None:
        self.seq += 1
        self.events.append({"seq": self.seq, "ts": time.time(), "model": model,
                            "engine_id": f"{self.name}-{model}", "from": src, "to": dst,
                            "reason": reason, "message": ""})
        del self.events[:-256]
        self.version += 1
        self._body = None
        self.changed.set()
        self.changed = asyncio.Event()

    def snapshot(self) -> tuple[bytes, str]:
        if self._body is None:
            usable = self.card - GiB
            accs = [{"index": i, "id": f"GPU-{i}", "hbm_total_bytes": self.card,
                     "hbm_usable_bytes": usable, "hbm_used_bytes": 0,
                     "hbm_used_by_engines_bytes": 0, "hbm_free_bytes": usable}
                    for i in range(self.gpus)]
            self._body = json.dumps({"observed_at": time.time(), "accelerators": accs,
                                     "models": list(self.models.values()),
                                     "cached_artifacts": []}).encode()
        return self._body, f'"{self.version}"'


class Fleet:
    def __init__(self, count: int, gpus: int, card: int) -> None:
        self.agents = {agent_ip(i): FakeAgent(f"agent-{i}", gpus, card) for i in range(count)}
        self.activations: dict[str, float] = {}
        self.calls: Counter[str] = Counter()
        self._ports = itertools.count(20000)

    def agent(self, request: web.Request) -> FakeAgent:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        agent = self.agents.get(sock[0]) if sock else None
        if agent is None:
            raise web.HTTPNotFound(text="no agent at this address")
        return agent

    async def snapshot(self, request: web.Request) -> web.Response:
        agent = self.agent(request)
        self.calls["snapshot"] += 1
        body, etag = agent.snapshot()
        if request.headers.get("If-None-Match") == etag:
            self.calls["snapshot_304"] += 1
            return web.Response(status=304, headers={"ETag": etag})
        return web.Response(body=body, content_type="application/json", headers={"ETag": etag})

    async def events(self, request: web.Request) -> web.Response:
        agent = self.agent(request)
        self.calls["events"] += 1
        since = int(request.query.get("since", "0"))
        wait = min(60.0, float(request.query.get("wait", "0")))
        if agent.seq <= since and wait > 0:
            try:
                await asyncio.wait_for(agent.changed.wait(), wait)
            except TimeoutError:
                pass
        page = [e for e in agent.events if e["seq"] > since][:1000]
        return web.json_response({"events": page, "cursor": agent.seq})

    async def control(self, request: web.Request) -> web.Response:
        agent = self.agent(request)
        kind = request.match_info["kind"]
        self.calls[kind] += 1
        body = await request.json()
        model = str(body.get("model_name", ""))
        entry = agent.models.get(model)
        if kind == "activate":
            if entry is None:
                self.activations[model] = time.time()
                ref = body.get("claim_ref") or {}
                kv = body.get("kv_limit_bytes")
                entry = agent.models[model] = {
                    "model_name": model, "engine": body.get("engine", "vllm"),
                    "artifact_url": body.get("artifact_url", ""), "claim_ref": ref,
                    "engine_id": f"{agent.name}-{model}", "port": next(self._ports),
                    "phase": "active", "ready": True, "alive": True, "operation": None,
                    "restart_count": 0, "last_error": None, "requests_running": 0,
                    "requests_waiting": 0, "request_success_total": 0,
                    "request_metrics_observed": True, "kv_limit_requested_bytes": kv,
                    "kv_limit_applied_bytes": kv, "kv_used_bytes": 0,
                    "kv_segment": {"present": True}, "conditions": [], "hbm_bytes": None,
                    "sleeping_footprint_bytes": None, "devices": list(range(agent.gpus))}
                agent.touch(model, "activating", "active", "Ready")
            return web.json_response({"status": "success", "model_name": model,
                                      "port": entry["port"], "phase": entry["phase"]})
        if entry is None:
            return web.json_response({"status": "error", "message": f"no model {model!r}"},
                                     status=404)
        if kind == "deactivate":
            del agent.models[model]
            agent.touch(model, entry["phase"], "stopped", "Stopped")
            return web.json_response({"status": "success", "model_name": model})
        if kind == "kv-limit":
            limit = int(body["limit_bytes"])
            applied = entry["kv_limit_applied_bytes"] != limit
            entry["kv_limit_requested_bytes"] = entry["kv_limit_applied_bytes"] = limit
            if applied:
                agent.touch(model, entry["phase"], entry["phase"], "KVLimitSet")
            return web.json_response({"status": "success", "model_name": model,
                                      "applied": True, "requested_bytes": limit,
                                      "applied_bytes": limit, "phase": entry["phase"]})
        target = "sleeping" if kind == "sleep" else "active"
        applied = entry["phase"] != target
        if applied:
            src, entry["phase"], entry["ready"] = entry["phase"], target, target == "active"
            entry["sleeping_footprint_bytes"] = 512 << 20 if target == "sleeping" else None
            agent.touch(model, src, target, "Slept" if kind == "sleep" else "Woken")
        return web.json_response({"status": "success", "model_name": model, "applied": applied,
                                  "phase": entry["phase"]})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def report(self, request: web.Request) -> web.Response:
        if request.match_info["what"] == "activations":
            return web.json_response(self.activations)
        return web.json_response(dict(self.calls))

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/runtime/snapshot", self.snapshot)
        app.router.add_get("/v1/runtime/events", self.events)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_post("/v1/runtime/models/{kind}", self.control)
        return app

    def control_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/{what}", self.report)
        return app


async def serve(count: int, port: int, control: int, gpus: int, card: int) -> None:
    fleet = Fleet(count, gpus, card)
    runner = web.AppRunner(fleet.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    for ip in fleet.agents:
        await web.TCPSite(runner, ip, port, backlog=512).start()
    ctl = web.AppRunner(fleet.control_app(), access_log=None)
    await ctl.setup()
    await web.TCPSite(ctl, "127.0.0.1", control).start()
    print(f"fake agents: {count} on 127.0.x.y:{port}, control on 127.0.0.1:{control}",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await ctl.cleanup()


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--port", type=int, default=18080)
    p.add_argument("--control", type=int, default=18079)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--card-gib", type=int, default=80)
    args = p.parse_args()
    raise_fd_limit()
    asyncio.run(serve(args.count, args.port, args.control, args.gpus, args.card_gib * GiB))


if __name__ == "__main__":
    main()
