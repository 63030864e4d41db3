"""A hostile engine costs the agent's control call a plain failure within its timeout, nothing
more: ``engines.client.EngineClient`` (over ``engine_http``, the door's client) against the
raw-socket engine stand-in (``tests.malformed_engine``, a process) answering the agent's
``/health``, ``/metrics``, ``/is_sleeping``, ``/v1/models`` and lifecycle POSTs with each shape
that breaks HTTP: a negative or huge length, bad chunks, bad headers, a stall, an endless or
trickled body, an unknown charset. Every call returns its plain result (False, None) or raises
``EngineCallError`` within its timeout, the event loop is never blocked (``tests.guards``), no
connection that carried a broken answer is used again, and an engine restarted on the same
port is reached again at once."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_http.upstream import Upstream
from engines.client import EngineCallError, EngineClient
from tests.guards import event_loop_guard
from tests.harness import SimProcess, engine_port, http_json
from tests.malformed_engine import ALL_SHAPES
from tests.malformed_engine import spawn as _spawn
from tests.malformed_engine import stop as _stop

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TIMEOUT_S = 1.0  # each call's own timeout
SLACK_S = 3.0  # a loaded machine's lateness on top of it
CALLS = ("health", "metrics", "is_sleeping", "models", "post")


@pytest.fixture(scope="module")
def bad_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    log = tmp_path_factory.mktemp("bad") / "bad.log"
    proc = _spawn(["-m", "tests.malformed_engine"], log, pipe=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # "PORT n", once it listens
        assert line.startswith("PORT "), log.read_text()
        yield int(line.split()[1])
    finally:
        _stop(proc)


async def _ask(client: EngineClient, call: str, shape: str,
               timeout_s: float = TIMEOUT_S) -> object:
    """One control call; its plain result, or the EngineCallError it raised."""
    if call != "post":  # a GET's answer is the shape the engine was last told to give GETs
        await client.post("/", 5, {"shape": "gets", "as": shape})
    try:
        if call == "health":
            return await client.health(timeout_s)
        if call == "metrics":
            return await client.metrics_page(timeout_s)
        if call == "is_sleeping":
            return await client.is_sleeping(timeout_s)
        if call == "models":
            return await client.served_models(timeout_s)
        return await client.post("/", timeout_s, {"shape": shape})
    except EngineCallError as err:
        return err


def _expected(call: str, shape: str, got: object) -> bool:
    answers = ALL_SHAPES[shape].door == "200"  # a whole, valid answer
    if call == "health":
        return got is answers
    if call == "post":
        return isinstance(got, str) if answers else isinstance(got, EngineCallError)
    if call == "metrics":
        return got == (None, None)  # the stand-in's JSON is no exposition
    return got is None  # nor an answer to /is_sleeping or /v1/models


async def _calls(port: int, steps: list[tuple[str, str]]) -> list[tuple[str, str, object, float]]:
    """``steps`` over one pool, the loop guarded; each result with the seconds it took."""
    out = []
    async with event_loop_guard(), Upstream(timeout=None) as http:
        client = EngineClient(http, "127.0.0.1", port)
        for call, shape in steps:
            started = time.monotonic()
            got = await asyncio.wait_for(_ask(client, call, shape), 30)
            out.append((call, shape, got, time.monotonic() - started))
    return out


def _reused(port: int) -> list[str]:
    status, doc = http_json(f"http://127.0.0.1:{port}/", "POST", {"shape": "report"})
    assert status == 200, doc
    return list(doc["reused"])


@given(st.lists(st.tuples(st.sampled_from(CALLS), st.sampled_from(sorted(ALL_SHAPES))),
                min_size=1, max_size=4))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
def test_a_hostile_answer_to_any_control_call_is_a_plain_failure_within_its_timeout(
        bad_engine: int, steps: list[tuple[str, str]]) -> None:
    for call, shape, got, took in asyncio.run(_calls(bad_engine, steps)):
        assert _expected(call, shape, got), (call, shape, got)
        assert took < TIMEOUT_S + SLACK_S, (call, shape, took)
    assert _reused(bad_engine) == []  # no connection that carried a broken answer was used again


def test_every_shape_fails_health_and_a_lifecycle_call_and_the_engine_is_served_after(
        bad_engine: int) -> None:
    steps = [(call, shape) for shape in sorted(ALL_SHAPES) for call in ("health", "post")]
    results = asyncio.run(_calls(bad_engine, [*steps, ("health", "ok"), ("post", "ok")]))
    wrong = [(call, shape, got) for call, shape, got, _ in results
             if not _expected(call, shape, got)]
    assert wrong == []
    assert max(took for *_, took in results) < TIMEOUT_S + SLACK_S
    assert _reused(bad_engine) == []


def test_an_endless_answer_to_a_lifecycle_call_is_cut_at_the_bound_not_read_to_the_timeout(
        bad_engine: int) -> None:
    """aiohttp's client read a POST's whole answer: an engine's endless body was held in
    memory until the call's timeout. Now it is refused at ``MAX_ANSWER`` bytes."""

    long_timeout = 30.0

    async def sleep_call(shape: str) -> tuple[object, float]:
        async with event_loop_guard(), Upstream(timeout=None) as http:
            started = time.monotonic()
            got = await asyncio.wait_for(_ask(EngineClient(http, "127.0.0.1", bad_engine),
                                              "post", shape, long_timeout), 60)
            return got, time.monotonic() - started

    for shape in ("endless_body", "endless_chunks"):
        got, took = asyncio.run(sleep_call(shape))
        assert isinstance(got, EngineCallError) and "over" in str(got), (shape, got)
        assert took < long_timeout / 3, (shape, took)


def test_an_unknown_charset_is_read_as_utf8_not_raised_into_the_owner(bad_engine: int) -> None:
    """aiohttp decoded by the answer's charset: ``charset=no-such-codec`` raised LookupError
    out of ``health()``, past the error contract, into the owner's probe."""
    results = asyncio.run(_calls(bad_engine, [("health", "unknown_charset"),
                                              ("post", "unknown_charset")]))
    assert [got for _, _, got, _ in results] == [True, json.dumps(
        {"id": "cmpl-1", "object": "chat.completion", "choices": []}, separators=(",", ":"))]


def test_an_engine_restarted_on_the_same_port_is_reached_again(tmp_path: Path) -> None:
    """The pool holds a connection to the engine that died; the next call on the same port goes
    to the new engine, not to the old connection (it is dropped, or retried once)."""
    port = engine_port()

    def start(n: int) -> subprocess.Popen[bytes]:
        log = tmp_path / f"engine{n}.log"
        proc = _spawn(["-m", "engines.sim", "serve", "t/m", "--host", "127.0.0.1", "--port",
                       str(port), "--sim-startup-seconds", "0.05"], log)
        SimProcess(proc, port, log, time.monotonic()).wait_ready()
        return proc

    async def health_then(restart: object) -> list[bool]:
        async with Upstream(timeout=None) as http:
            client = EngineClient(http, "127.0.0.1", port)
            seen = [await client.health(5)]
            await asyncio.to_thread(restart)  # type: ignore[arg-type]
            seen.append(await client.health(5))
            return seen

    procs = [start(1)]
    try:
        def restart() -> None:
            _stop(procs[0])
            procs.append(start(2))

        assert asyncio.run(health_then(restart)) == [True, True]
    finally:
        for proc in procs:
            _stop(proc)
