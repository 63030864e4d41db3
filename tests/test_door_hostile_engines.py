"""An engine that breaks HTTP costs its own request and nothing else: the door (its real server,
upstream client and routes, over the reconciler's state from a fake agent) in front of two engine
processes: ``bad``, a raw-socket stand-in answering each malformed shape
(``tests.malformed_engine``), and ``good``, the simulated vLLM engine. Every malformed answer is a
502 (a stall past the upstream timeout a 504; a broken stream an error event) in OpenAI's error
shape, no broken connection is used again, and requests to ``good`` sent meanwhile are answered
200 throughout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from reconciler.door.ledger import Ledger
from reconciler.door.service import FrontDoor
from reconciler.door.settings import DoorSettings
from tests.harness import SimProcess, engine_port
from tests.malformed_engine import SHAPES
from tests.malformed_engine import spawn as _spawn
from tests.malformed_engine import stop as _stop
from tests.reconciler_fakes import FakeAgent, Rig, claim_yaml
from tests.test_reconciler_claims_lifecycle import active_claim

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
TIMEOUT_S = 2.0  # the door's upstream timeout here (a loaded machine answers within it)
CHAT = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def bad_engine(tmp_path: Path) -> Iterator[int]:
    proc = _spawn(["-m", "tests.malformed_engine"], tmp_path / "bad.log", pipe=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # "PORT n", once it listens
        assert line.startswith("PORT "), (tmp_path / "bad.log").read_text()
        yield int(line.split()[1])
    finally:
        _stop(proc)


@pytest.fixture
def good_engine(tmp_path: Path) -> Iterator[int]:
    port = engine_port()
    log = tmp_path / "good.log"
    proc = _spawn(["-m", "engines.sim", "serve", "t/good", "--served-model-name", "good",
                   "--host", "127.0.0.1", "--port", str(port), "--sim-startup-seconds", "0.05"],
                  log)
    try:
        SimProcess(proc, port, log, time.monotonic()).wait_ready()
        yield port
    finally:
        _stop(proc)


@pytest.fixture
async def door(tmp_path: Path, bad_engine: int,
               good_engine: int) -> AsyncIterator[tuple[FrontDoor, aiohttp.ClientSession]]:
    agent = FakeAgent("agent-a")
    agent._url = "http://127.0.0.1:9"  # the route's host: engines on this machine's loopback
    rig = Rig(tmp_path, [agent], claim_yaml("good") + claim_yaml("bad"))
    for name, port in (("good", good_engine), ("bad", bad_engine)):
        await active_claim(rig, agent, name)
        agent.set(name, port=port)
        await rig.reconcile(name)
        assert rig.status(name).instances[0].port == port
    front = FrontDoor(DoorSettings(port=0, access_log="off", upstream_timeout_s=TIMEOUT_S),
                      rig.deps, CollectorRegistry(), Ledger())
    await front.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{front.port}") as http:
            yield front, http
    finally:
        await front.stop()


async def ask(http: aiohttp.ClientSession, model: str, **extra: Any) -> tuple[int, bytes, str]:
    body = {"model": model, "messages": CHAT, "max_tokens": 4, **extra}
    async with http.post("/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.read(), resp.headers.get("Content-Type", "")


def is_openai_error(body: bytes, status: int) -> bool:
    import json

    doc = json.loads(body)
    error = doc.get("error") if isinstance(doc, dict) else None
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} \
        and bool(error["message"]) and (status != 504 or "sent nothing" in error["message"])


async def test_each_malformed_answer_fails_its_own_request_while_another_model_is_served(
        door: tuple[FrontDoor, aiohttp.ClientSession], bad_engine: int) -> None:
    front, http = door
    assert (await ask(http, "good"))[0] == 200  # the engine's first answer, before the clock
    bad = {name: asyncio.ensure_future(ask(http, "bad", shape=name)) for name in SHAPES}
    served: list[float] = []
    while not all(task.done() for task in bad.values()):  # the other model, all along
        started = time.monotonic()
        status, body, _ = await asyncio.wait_for(ask(http, "good"), 10)
        assert status == 200 and b"choices" in body, body
        served.append(time.monotonic() - started)
    assert len(served) >= 3 and max(served) < 5
    for name, task in bad.items():
        status, body, kind = task.result()
        want = SHAPES[name].door
        if want in ("502", "504"):
            assert status == int(want) and kind == "application/json", (name, status, body)
            assert is_openai_error(body, status), (name, body)
        elif want == "200":
            assert status == 200 and body.startswith(b'{"id":"cmpl-1"'), (name, body)
        else:  # a stream already begun: it ends with an error event, then [DONE]
            assert status == 200 and kind.startswith("text/event-stream"), (name, status)
            assert body.startswith(b"data: {\"id\":\"cmpl-1\"") and body.endswith(
                b"data: [DONE]\n\n") and b'"code": "upstream_error"' in body, (name, body)
            assert (b"sent nothing" in body) == (want == "stream-timeout"), (name, body)
    async with aiohttp.ClientSession() as direct:  # no broken connection was used again
        async with direct.post(f"http://127.0.0.1:{bad_engine}/",
                               json={"shape": "report"}) as resp:
            report = await resp.json()
    assert report["reused"] == [], report
    status, body, _ = await ask(http, "bad", shape="ok")  # and the engine is served again
    assert status == 200 and body.startswith(b'{"id":"cmpl-1"')


async def test_only_the_headers_the_door_names_are_passed_on_never_hop_by_hop_ones(
        door: tuple[FrontDoor, aiohttp.ClientSession]) -> None:
    _, http = door
    body = {"model": "bad", "messages": CHAT, "shape": "hop_by_hop"}
    async with http.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and (await resp.read()).startswith(b'{"id":"cmpl-1"')
        names = {name.lower() for name in resp.headers}
    assert names == {"content-type", "content-length", "date", "x-request-id", "cache-control"}
    assert resp.headers["X-Request-Id"] == "r-1" and resp.headers["Cache-Control"] == "no-store"


async def test_a_stalled_engine_is_given_up_after_the_upstream_timeout_not_before(
        door: tuple[FrontDoor, aiohttp.ClientSession]) -> None:
    _, http = door
    started = time.monotonic()
    status, body, _ = await ask(http, "bad", shape="stall_body")
    took = time.monotonic() - started
    assert status == 504 and is_openai_error(body, status)
    assert TIMEOUT_S <= took < TIMEOUT_S * 2 + 2, took


def test_the_upstream_timeout_is_an_operators_flag_and_must_be_positive() -> None:
    from reconciler.cli import door_settings
    from runtime_agent.cli import parser

    argv = ["reconcile", "--claims", "c", "--pool", "p", "--door-port", "0"]
    args = parser().parse_args([*argv, "--door-upstream-timeout", "30"])
    settings = door_settings(args, "127.0.0.1")
    assert settings is not None and settings.upstream_timeout_s == 30.0
    default = door_settings(parser().parse_args(argv), "h")
    assert default is not None and default.upstream_timeout_s == 600.0
    with pytest.raises(SystemExit, match="--door-upstream-timeout positive"):
        door_settings(parser().parse_args([*argv, "--door-upstream-timeout", "0"]), "h")


def test_the_doors_own_asks_cut_a_hostile_engines_endless_answer_at_the_bound(
        bad_engine: int, tmp_path: Path) -> None:
    """The door counted a prompt (``/tokenize``) over aiohttp, which read the whole answer: an
    endless one was held in memory until the ask's timeout (5 s). Over ``engine_http`` (as its
    other asks: ``/v1/models``, Ollama's lists) it is refused at the bound, at once."""
    from engine_http.calls import post_json
    from reconciler.door.door import TOKENIZE_TIMEOUT_S
    from tests.test_door_admit import door_for

    async def counts() -> list[tuple[str, int | None, float]]:
        door = door_for(Rig(tmp_path, [FakeAgent("agent-a")], claim_yaml("m")))
        out = []
        try:
            for shape in ("endless_body", "endless_chunks"):
                reply = await post_json(door.upstream, "127.0.0.1", bad_engine, "/",
                                        {"shape": "gets", "as": shape}, 5)
                assert reply.status == 200
                started = time.monotonic()
                got = await door._tokenize(("127.0.0.1", bad_engine), {"prompt": "x"})
                out.append((shape, got, time.monotonic() - started))
        finally:
            door.upstream.close()
        return out

    for shape, got, took in asyncio.run(counts()):
        assert got is None and took < TOKENIZE_TIMEOUT_S / 2, (shape, took)
