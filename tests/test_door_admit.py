"""Holding requests against fake agents: one wake for many requests, bounded queues and waits,
cancelled requests leave, a model with a request in flight is never put to sleep, and a replica
that cannot serve refuses everything."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import aiohttp
from prometheus_client import CollectorRegistry

from engine_http.upstream import Upstream
from reconciler.door.access import AccessLog, AccessRecord
from reconciler.door.door import Door, Refused
from reconciler.door.keys import KeyFile
from reconciler.door.ledger import Changes, Ledger, Ticket
from reconciler.door.metrics import DoorMetrics
from reconciler.door.plan import Forward
from reconciler.door.routing import Rechoice, Routed
from reconciler.door.server import make_server
from reconciler.door.settings import DoorSettings
from contract.quantity import GiB
from tests.reconciler_fakes import FakeAgent, Rig, claim_yaml
from tests.test_door_modelroute import route
from tests.test_door_route_choice import labelled
from tests.waits import until
from tests.test_reconciler_claims_lifecycle import (
    IDLE_POLICY,
    ROOM_POLICY,
    active_claim,
    asleep_beside,
)

pytestmark = pytest.mark.timeout(30)
M = ("default", "m")


def door_for(rig: Rig, **settings: float) -> Door:
    ledger, changes = Ledger(), Changes()
    rig.deps.reader.in_flight = ledger.in_flight
    rig.store.listen(changes.bump)
    rig.deps.books.holds.listen(changes.bump)
    s = DoorSettings(port=0, **settings)  # type: ignore[arg-type]
    return Door(s, rig.deps, DoorMetrics(CollectorRegistry(), ledger), ledger, changes)


def record() -> AccessRecord:
    return AccessRecord("POST", "/v1/chat/completions", "-", time.monotonic())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def sleeping_m(tmp_path: Path) -> tuple[Rig, FakeAgent]:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=IDLE_POLICY)
    await active_claim(rig, a, "m")
    await rig.reconcile("m", advance=61)
    assert rig.status("m").phase == "Sleeping"
    return rig, a


async def test_requests_for_a_sleeping_model_ask_one_wake_and_go_once_it_serves(
        tmp_path: Path) -> None:
    rig, a = await sleeping_m(tmp_path)
    door = door_for(rig)
    tickets = [Ticket(door.ledger) for _ in range(3)]
    waiting = [asyncio.ensure_future(door.admit("m", (M,), t, record())) for t in tickets]
    await settle()
    req = rig.deps.books.wakes.get("m")
    assert req is not None and req.repeats == 2 and rig.claim_kicks == [M]
    assert door.ledger.held("m") == 3 and door.ledger.in_flight("m") == 3
    assert not any(w.done() for w in waiting)
    await rig.reconcile("m")  # wakes it
    await rig.reconcile("m")  # sees it serve: Active, on the route
    got = await asyncio.wait_for(asyncio.gather(*waiting), 5)
    port = a.models["m"]["port"]
    assert got == [Forward(M, "agent-a.pool", port, "agent-a")] * 3
    assert a.calls_of("wake") == [("wake", "m")]
    assert door.ledger.held("m") == 0 and door.ledger.in_flight("m") == 3
    for t in tickets:
        t.leave()
    assert door.ledger.in_flight("m") == 0


async def test_past_its_bound_a_request_is_refused_at_once_with_retry_after(
        tmp_path: Path) -> None:
    rig, _ = await sleeping_m(tmp_path)
    door = door_for(rig, max_held=1)
    first = asyncio.ensure_future(door.admit("m", (M,), Ticket(door.ledger), record()))
    await settle()
    with pytest.raises(Refused) as refused:
        await door.admit("m", (M,), Ticket(door.ledger), record())
    assert refused.value.reason == "queue_full"
    assert refused.value.response.status == 503
    assert refused.value.response.headers["Retry-After"] == "10"
    first.cancel()


async def test_a_held_request_gives_up_after_the_wait_bound(tmp_path: Path) -> None:
    rig, _ = await sleeping_m(tmp_path)
    door = door_for(rig, max_wait_s=0.2, recheck_s=0.05)
    ticket = Ticket(door.ledger)
    with pytest.raises(Refused) as refused:
        await door.admit("m", (M,), ticket, record())
    assert refused.value.reason == "wait_timeout"
    assert refused.value.response.headers["Retry-After"] == "10"
    assert b"did not become ready within 0.2 s (waiting for: wake)" in \
        refused.value.response.body  # type: ignore[operator]
    assert door.ledger.held("m") == 0


async def test_a_cancelled_held_request_leaves_the_queue(tmp_path: Path) -> None:
    rig, _ = await sleeping_m(tmp_path)
    door = door_for(rig, max_held=1)
    ticket = Ticket(door.ledger)
    held = asyncio.ensure_future(door.admit("m", (M,), ticket, record()))
    await settle()
    assert door.ledger.held("m") == 1
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    ticket.leave()
    assert door.ledger.held("m") == 0 and door.ledger.in_flight("m") == 0
    again = asyncio.ensure_future(door.admit("m", (M,), Ticket(door.ledger), record()))
    await settle()
    assert door.ledger.held("m") == 1 and not again.done()
    again.cancel()


async def test_a_held_request_cancelled_as_a_change_comes_leaves_the_queue(
        tmp_path: Path) -> None:
    """A client that leaves (or a door that stops) as a status changes: the cancel must end
    the handler, whichever loop turn the change came in (``asyncio.wait_for`` on 3.11 dropped
    a cancel that came with the change, and the request stayed held)."""
    rig, _ = await sleeping_m(tmp_path)
    door = door_for(rig, max_wait_s=30)
    for turns in range(3):
        held = asyncio.ensure_future(door.admit("m", (M,), Ticket(door.ledger), record()))
        await settle()
        assert door.ledger.held("m") == 1
        door.changes.bump()
        for _ in range(turns):
            await asyncio.sleep(0)
        held.cancel()
        done, _ = await asyncio.wait({held}, timeout=2)
        assert done and held.cancelled(), f"the cancel was lost ({turns} turns after a change)"
        assert door.ledger.held("m") == 0


async def test_a_request_for_an_unplaced_claim_kicks_it_and_waits_for_room(
        tmp_path: Path) -> None:
    a = FakeAgent("agent-a", card=8 * GiB)
    claims = "".join(claim_yaml(n, footprint="2Gi") for n in ("one", "two", "three"))
    rig = Rig(tmp_path, [a], claims, policy=ROOM_POLICY)
    await active_claim(rig, a, "one")
    await active_claim(rig, a, "two")
    await rig.reconcile("three")
    assert rig.status("three").phase == "Pending"
    door = door_for(rig)
    rec = record()
    three = ("default", "three")
    waiting = asyncio.ensure_future(door.admit("three", (three,), Ticket(door.ledger), rec))
    await settle()
    assert rig.claim_kicks[-1] == three and rec.held_for == "room"
    rig.clock.advance(31)
    await rig.reconcile("three")  # puts 'one' to sleep for room
    await rig.reconcile("three")  # places 'three'
    a.serve("three")
    await rig.reconcile("three")
    got = await asyncio.wait_for(waiting, 5)
    assert isinstance(got, Forward) and got.claim == three
    assert a.calls_of("sleep") == [("sleep", "one", 1)] and rec.held_ms is not None


# ---- in flight through the door: busy -----------------------------------------------------


async def test_a_model_with_a_request_in_flight_through_the_door_is_not_put_to_sleep(
        tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"), policy=IDLE_POLICY)
    await active_claim(rig, a, "m")
    door = door_for(rig)
    ticket = Ticket(door.ledger)
    assert await door.admit("m", (M,), ticket, record()) == Forward(
        M, "agent-a.pool", a.models["m"]["port"], "agent-a")
    await rig.reconcile("m", advance=61)  # the engine itself shows no request yet
    assert a.calls_of("sleep") == [] and rig.status("m").phase == "Active"
    assert "m" not in rig.deps.books.holds
    ticket.leave()
    result = await rig.reconcile("m", advance=61)
    while not a.calls_of("sleep"):
        assert result.requeue_after is not None
        result = await rig.reconcile("m", advance=result.requeue_after)
    assert a.calls_of("sleep") == [("sleep", "m", 1)]


async def test_a_model_with_a_request_in_flight_is_not_slept_to_make_room(
        tmp_path: Path) -> None:
    a = FakeAgent("agent-a", card=8 * GiB)
    claims = "".join(claim_yaml(n, footprint="2Gi") for n in ("old", "sleeper"))
    rig = Rig(tmp_path, [a], claims, policy=ROOM_POLICY)
    await asleep_beside(rig, a, "old")
    a.add("hog", claim=None, hbm_bytes=3 * GiB)  # no room for 'sleeper' beside 'old'
    rig.clock.advance(60)
    door = door_for(rig)
    door.ledger.enter("old")
    rig.deps.books.wakes.request("sleeper", ("default", "sleeper"), rig.clock.now(), 0.0)
    await rig.reconcile("sleeper")
    assert ("sleep", "old", 1) not in a.calls
    door.ledger.leave("old")
    await rig.reconcile("sleeper", advance=1)
    assert ("sleep", "old", 1) in a.calls


async def test_a_request_held_for_a_claim_deleted_meanwhile_is_told_the_model_is_gone(
        tmp_path: Path) -> None:
    rig, _ = await sleeping_m(tmp_path)
    door = door_for(rig)
    held = asyncio.ensure_future(door.admit("m", (M,), Ticket(door.ledger), record()))
    await settle()
    rig.write_claims("# every claim deleted\n")  # (an empty file is a read caught mid-write)
    await rig.reconcile("m")  # the drain marks the status deleted: a change
    with pytest.raises(Refused) as refused:
        await asyncio.wait_for(held, 5)
    assert refused.value.reason == "unknown_model" and refused.value.response.status == 404


# ---- names the engines serve ------------------------------------------------------------------


async def test_served_names_and_lora_adapters_an_engine_lists_route_to_its_claim(
        tmp_path: Path) -> None:
    from aiohttp import web

    async def models(request: web.Request) -> web.Response:  # vLLM's /v1/models, one adapter
        return web.json_response({"object": "list", "data": [
            {"id": "m", "object": "model", "root": "t/m", "parent": None, "max_model_len": 8192},
            {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": "m",
             "max_model_len": 8192}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    a = FakeAgent("agent-a")
    rig = Rig(tmp_path, [a], claim_yaml("m"))
    door = door_for(rig)
    try:
        assert door.catalog.claims_for("sql-lora") == ()
        assert door.catalog.context(M, "m") == 2048  # declared, until the engine says
        async with Upstream(timeout=None) as http:
            door.catalog.learn_soon(http, M, "127.0.0.1", port)
            for _ in range(100):
                if door.catalog.claims_for("sql-lora"):
                    break
                await asyncio.sleep(0.02)
        assert door.catalog.claims_for("sql-lora") == (M,)
        assert door.catalog.adapters(M) == ("sql-lora",)
        assert door.catalog.context(M, "sql-lora") == 8192 == door.catalog.context(M, "m")
        listed = {m["id"]: m for m in door.listing(None)}
        assert listed["sql-lora"]["parent"] == "m" and listed["m"]["parent"] is None
    finally:
        await runner.cleanup()


# ---- a replica that cannot serve (a Kubernetes standby) ---------------------------------------


async def test_a_replica_that_cannot_serve_answers_every_route_503_and_asks_nothing(
        tmp_path: Path) -> None:
    rig, a = await sleeping_m(tmp_path)  # a request that got through would ask for a wake
    door = door_for(rig)
    why: list[str | None] = ["this replica stands by"]
    door.standby = lambda: why[0]
    server = make_server(door, KeyFile(None), AccessLog("off"))
    port = await server.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
                resp = await client.request(method, path, json={"model": "m", "messages": []})
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert resp.headers["Connection"].lower() == "close"
                assert await resp.json() == {"error": {
                    "message": "this replica stands by", "type": "service_unavailable",
                    "param": None, "code": "not_leading"}}
            resp = await client.get("/healthz")
            assert resp.status == 503 and (await resp.json())["status"] == "standby"
            assert rig.deps.books.wakes.get("m") is None and rig.claim_kicks == []
            assert door.ledger.in_flight("m") == 0 and a.calls_of("wake") == []
            why[0] = None  # it leads now
            resp = await client.get("/healthz")
            assert resp.status == 200 and await resp.json() == {"status": "ok"}
    finally:
        await server.stop()


async def test_held_requests_are_answered_503_when_the_replica_stops_serving(
        tmp_path: Path) -> None:
    rig, _ = await sleeping_m(tmp_path)
    door = door_for(rig)
    why: list[str | None] = [None]
    door.standby = lambda: why[0]
    ticket = Ticket(door.ledger)
    held = asyncio.ensure_future(door.admit("m", (M,), ticket, record()))
    await settle()
    assert door.ledger.held("m") == 1 and not held.done()
    why[0] = "this replica no longer leads"
    door.changes.bump()  # what the Kubernetes app does when it stops leading
    with pytest.raises(Refused) as refused:
        await asyncio.wait_for(held, 5)
    assert refused.value.reason == "not_leading" and refused.value.response.status == 503
    assert door.ledger.held("m") == 0
    ticket.leave()
    assert door.ledger.in_flight("m") == 0


async def test_a_held_route_call_whose_claim_is_deleted_goes_to_the_routes_next_choice(
        tmp_path: Path) -> None:
    a = FakeAgent("agent-a")
    both = labelled("big", "big", 2048) + labelled("small", "small", 2048)
    rig = Rig(tmp_path, [a], both + "---\n" + route("chat"), policy=IDLE_POLICY)
    for name in ("big", "small"):
        await active_claim(rig, a, name)
    for name in ("big", "small"):
        await rig.reconcile(name, advance=61)
        assert rig.status(name).phase == "Sleeping"
    door = door_for(rig, recheck_s=0.05)
    chat = rig.desired.routes["chat"]
    body = b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}'
    doc = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    first = door.router.choose(chat, "chat", doc, body)
    assert first == Routed("chat", "woken", ("default", "big"), "big")
    assert isinstance(first, Routed)
    again = Rechoice(door.router, chat, "chat", doc, body, first, lambda k: True)
    held = asyncio.ensure_future(door.admit("big", (first.claim,), Ticket(door.ledger), record(),
                                            None, again))
    await settle()
    assert rig.deps.books.wakes.get("big") is not None and not held.done()
    rig.write_claims(labelled("small", "small", 2048) + "---\n" + route("chat"))
    # the held call's next look: big is gone, small is chosen and its wake asked
    await until("small's wake asked", lambda: rig.deps.books.wakes.get("small") is not None, 5)
    assert not held.done()
    await rig.reconcile("small")  # wakes it
    await rig.reconcile("small")  # sees it serve
    got = await asyncio.wait_for(held, 5)
    assert got == Forward(("default", "small"), "agent-a.pool", a.models["small"]["port"],
                          "agent-a")
    assert again.routed == Routed("chat", "woken", ("default", "small"), "small",
                                  rechosen_from=("default", "big"))
