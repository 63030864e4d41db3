"""Replicas end to end (issue 25): a local WarmPool of two real agents (simulated GPUs and
engines, separate processes), the reconciler and its front door in the test process, and
clients over real sockets. A claim with ``replicas: 2`` runs an engine on each agent; the door
spreads requests over both, sends a request whose engine is gone to the other, and scaling down
stops one. (The walk of docs/fields.md's claim table has one agent; the replicas' own fields
are checked here.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine_http.framing import UpstreamUnreachable
from engine_http.upstream import Upstream
from reconciler.context import Timings
from reconciler.door.settings import DoorSettings
from reconciler.local.app import ReconcilerApp, Settings
from tests import test_reconciler_integration as integration
from tests.harness import AgentProcess, free_port
from tests.reconciler_fakes import claim_yaml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]
GiB = 1 << 30
CARD = ["--simulate-gpus", "1x16GiB", "--gpu-reserve", "1GiB"]
SIM = {"--sim-startup-seconds": "0.2", "--sim-memory-bytes": str(GiB),
       "--sim-kv-capacity-bytes": str(16 * GiB)}
CHAT = [{"role": "user", "content": "Say hello."}]


def replicated(name: str, replicas: int, **args: str) -> str:
    text = claim_yaml(name, f"{name}-model", "6Gi", "1Gi", {**SIM, **args})
    return text.replace("  engine: vllm\n", f"  engine: vllm\n  replicas: {replicas}\n")


class Pool(integration.Pool):
    """Two agents, a claims directory, the reconciler and its door in this process."""

    def __init__(self, tmp: Path, agents: list[AgentProcess]) -> None:
        super().__init__(tmp, agents)
        self.tmp = tmp
        self.http: aiohttp.ClientSession | None = None

    async def start(self, allow_release: bool = False) -> ReconcilerApp:
        settings = DoorSettings(port=0, access_log=str(self.tmp / "access.log"),
                                allow_release=allow_release)
        self.app = ReconcilerApp(Settings(self.dir, port=0, door=settings,
                                          timings=replace(Timings(), kv_resync=1.0)))
        await self.app.start()
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self.app

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
        if self.app is not None:
            await self.app.stop()

    @property
    def door(self) -> str:
        assert self.app is not None and self.app.door is not None
        return f"http://127.0.0.1:{self.app.door.port}"

    def doc(self, name: str) -> dict[str, Any]:
        st = self.status(name)
        assert st is not None
        return st.as_json()["status"]

    async def until(self, what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
        """As the pool's, with room for a loaded machine (every wait here is on an event)."""
        await super().until(what, check, timeout)

    def _claims(self) -> str:
        """The statuses, and what the agents say of their engines (for a wait that gave up)."""
        engines: dict[str, list[Any]] = {}
        for agent_name, agent in self.agents.items():
            try:
                engines[agent_name] = [(m["model_name"], m["phase"], m["ready"],
                                        m.get("kv_limit_applied_bytes"), m.get("last_error"))
                                       for m in agent.client.snapshot()["models"]]
            except Exception as err:  # an agent that does not answer says so
                engines[agent_name] = [str(err)]
        return f"{super()._claims()}; engines: {engines}"

    async def serving(self, name: str, replicas: int) -> None:
        await self.until(f"{name}: {replicas} replicas ready", lambda: self.status(name)
                         is not None and self.doc(name)["readyReplicas"] == replicas)

    async def asleep(self, after_s: int) -> None:
        """Claim ``m`` with two replicas, each put to sleep when idle ``after_s`` seconds."""
        self.write_pool(f'{{"lifecycle": {{"sleepAfterSeconds": {after_s}}}}}')
        self.write("m", replicated("m", 2))
        await self.start()
        await self.until("both replicas asleep", lambda: [
            s.phase if s else None for s in (self.status("m"), self.status("m#1"))]
            == ["Sleeping", "Sleeping"])

    def engines(self, model: str) -> dict[str, dict[str, Any]]:
        """The engines of ``model``, by agent (the agents' own snapshots)."""
        out = {}
        for name, agent in self.agents.items():
            found = [m for m in agent.client.snapshot()["models"] if m["model_name"] == model]
            if found:
                out[name] = found[0]
        return out

    async def chat(self, model: str) -> tuple[int, dict[str, str]]:
        assert self.http is not None
        async with self.http.post(self.door + "/v1/chat/completions", json={
                "model": model, "messages": CHAT, "max_tokens": 4}) as resp:
            await resp.read()
            return resp.status, dict(resp.headers)

    def access(self) -> list[dict[str, Any]]:
        path = self.tmp / "access.log"
        return [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []


@pytest.fixture
async def pool(tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> AsyncIterator[Pool]:
    made = Pool(tmp_path, [agent_factory(restart_delays="0.05", extra_args=CARD)
                           for _ in range(2)])
    made.write_pool()
    yield made
    await made.close()


async def test_a_claim_with_two_replicas_runs_an_engine_on_each_agent(pool: Pool) -> None:
    pool.write("m", replicated("m", 2))
    await pool.start()
    await pool.serving("m", 2)
    doc = pool.doc("m")
    assert doc["phase"] == "Active" and doc["desiredReplicas"] == 2
    instances = doc["instances"]
    assert sorted(i["index"] for i in instances) == [0, 1]
    assert sorted(i["pod"] for i in instances) == ["agent-a", "agent-b"]
    assert all(i["phase"] == "Active" and i["port"] > 0 for i in instances)
    engines = pool.engines("m-model")
    assert sorted(engines) == ["agent-a", "agent-b"]
    assert sorted(e["claim_ref"]["name"] for e in engines.values()) == ["m", "m#1"]
    assert pool.app is not None
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{pool.app.port}/metrics") as resp:
            text = await resp.text()
        async with http.get(f"http://127.0.0.1:{pool.app.port}/v1/claims") as resp:
            listed = await resp.json()
        async with http.get(f"http://127.0.0.1:{pool.app.port}/v1/routes") as resp:
            routes = (await resp.json())["routes"]
    assert 'aibrix_modelclaim_ready_replicas{name="m",namespace="default"} 2.0' in text
    assert 'aibrix_modelclaim_desired_replicas{name="m",namespace="default"} 2.0' in text
    assert [c["metadata"]["name"] for c in listed["items"]] == ["m"]  # the replicas are in it
    assert sorted((r["agent"], r["claim"], r["state"]) for r in routes) == [
        ("agent-a", "default/m", "active"), ("agent-b", "default/m", "active")]


async def test_concurrent_requests_through_the_door_are_spread_over_both_replicas(
        pool: Pool) -> None:
    pool.write("m", replicated("m", 2, **{"--sim-request-seconds": "2"}))
    await pool.start()
    await pool.serving("m", 2)
    answers = await asyncio.gather(*(pool.chat("m-model") for _ in range(64)))
    assert [status for status, _ in answers] == [200] * 64
    await pool.until("64 access lines", lambda: len(pool.access()) >= 64)
    by_agent: dict[str, int] = {}
    for line in pool.access():
        agent = line["upstream"].split()[0]
        by_agent[agent] = by_agent.get(agent, 0) + 1
    # fewest in flight picked: while the first requests are still in the engines (two seconds
    # each), each new one goes to the replica with fewer, so neither gets most of them
    assert sorted(by_agent) == ["agent-a", "agent-b"], by_agent
    assert min(by_agent.values()) >= 16, by_agent


async def routed(pool: Pool, **args: str) -> None:
    """Claim ``m``, two replicas, both ready, the one candidate of ModelRoute ``chat``."""
    text = replicated("m", 2, **args)
    pool.write("m", text.replace("  namespace: default\n",
                                 '  namespace: default\n  labels: {family: "qwen"}\n', 1))
    pool.write("chat", "apiVersion: model.aibrix.ai/v1alpha1\nkind: ModelRoute\n"
               "metadata: {name: chat}\nspec:\n  require: {matchLabels: {family: qwen}}\n")
    await pool.start()
    await pool.serving("m", 2)


async def test_a_modelroutes_calls_are_spread_over_the_chosen_claims_replicas(
        pool: Pool) -> None:
    await routed(pool, **{"--sim-request-seconds": "2"})
    answers = await asyncio.gather(*(pool.chat("chat") for _ in range(16)))
    assert [status for status, _ in answers] == [200] * 16
    assert {h.get("x-route-claim") for _, h in answers} == {"default/m"}
    assert {h.get("x-route-agent") for _, h in answers} == {"agent-a", "agent-b"}


async def test_a_route_reads_a_claim_whose_replica_0_sleeps_and_replica_1_serves_as_warm(
        pool: Pool) -> None:
    """The route's choice once read each claim by replica 0: asleep, so the call was
    counted and answered as one that woke its claim (``woken``) though replica 1 served."""
    await routed(pool)
    assert pool.app is not None
    pool.app.deps.books.ask_release("m-model", ("default", "m"))  # replica 0 only
    await pool.until("replica 0 asleep, replica 1 serving", lambda: [
        s.phase if s else None for s in (pool.status("m"), pool.status("m#1"))]
        == ["Sleeping", "Active"])
    one = pool.status("m#1")
    assert one is not None and one.instance is not None
    status, headers = await pool.chat("chat")
    assert status == 200
    assert (headers.get("x-route-choice"), headers.get("x-route-agent")) \
        == ("warm", one.instance.agent)
    zero = pool.status("m")
    assert zero is not None and zero.phase == "Sleeping"  # nothing woke it


async def test_a_killed_replicas_requests_go_to_the_other_and_none_is_lost(
        pool: Pool) -> None:
    pool.write("m", replicated("m", 2))
    await pool.start()
    await pool.serving("m", 2)
    assert [s for s, _ in await asyncio.gather(*(pool.chat("m-model") for _ in range(8)))] \
        == [200] * 8  # the door holds kept-alive connections to both engines now
    st = pool.status("m#1")
    assert st is not None and st.instance is not None
    victim = st.instance.agent
    os.killpg(pool.engines("m-model")[victim]["pid"], signal.SIGKILL)
    # None of these reached the dead engine: each is answered, by the other replica when
    # the route still names the dead one (its port refuses the connection)
    answers = await asyncio.gather(*(pool.chat("m-model") for _ in range(32)))
    assert [status for status, _ in answers] == [200] * 32
    await pool.until("the killed replica restarted and serving again",
                     lambda: pool.doc("m")["readyReplicas"] == 2
                     and pool.engines("m-model")[victim]["restart_count"] >= 1)
    assert [s for s, _ in await asyncio.gather(*(pool.chat("m-model") for _ in range(8)))] \
        == [200] * 8


async def test_scaling_from_two_replicas_to_one_stops_one_engine(pool: Pool) -> None:
    pool.write("m", replicated("m", 2))
    await pool.start()
    await pool.serving("m", 2)
    st = pool.status("m#1")
    assert st is not None and st.instance is not None
    gone = st.instance.agent
    pool.write("m", replicated("m", 1))
    await pool.until("replica 1 drained", lambda: pool.status("m#1") is None)
    await pool.until("its engine stopped", lambda: gone not in pool.engines("m-model"))
    doc = pool.doc("m")
    assert doc["desiredReplicas"] == 1 and doc["readyReplicas"] == 1
    assert len(doc["instances"]) == 1 and doc["instances"][0]["pod"] != gone
    assert (await pool.chat("m-model"))[0] == 200


async def test_a_replica_with_no_other_pod_to_go_to_says_so_and_the_claim_serves(
        pool: Pool) -> None:
    pool.write_pool(only="agent-a")
    pool.write("m", replicated("m", 2))
    await pool.start()
    await pool.serving("m", 1)
    await pool.until("replica 1 waits for another Pod", lambda: (s := pool.status("m#1"))
                     is not None and s.reason("Scheduled") == "ReplicaNeedsAnotherPod")
    doc = pool.doc("m")
    assert doc["phase"] == "Active" and doc["readyReplicas"] == 1
    assert list(pool.engines("m-model")) == ["agent-a"]  # not stacked on the one Pod
    st = pool.status("m#1")
    assert st is not None and "runs another replica" in st.conditions["Scheduled"].message
    pool.write_pool()  # a second Pod: the replica goes there
    await pool.serving("m", 2)
    assert sorted(pool.engines("m-model")) == ["agent-a", "agent-b"]


async def test_idle_replicas_sleep_each_and_a_request_wakes_the_claim(pool: Pool) -> None:
    await pool.asleep(1)
    assert pool.doc("m")["phase"] == "Sleeping"
    status, _ = await pool.chat("m-model")
    assert status == 200  # served once a replica woke for it
    st = pool.status("m")
    assert st is not None
    assert [e["reason"] for e in st.as_json()["events"]].count("Woken") >= 1


async def test_a_burst_at_two_sleeping_replicas_wakes_one_of_them(pool: Pool) -> None:
    """Each held request once counted as in flight on the replica it waited for, so the
    next one of a burst picked the other sleeping replica (fewer "in flight") and asked a
    wake for it too: a burst woke every replica. The cheapest to wake, replica 0, wakes."""
    await pool.asleep(2)
    answers = await asyncio.gather(*(pool.chat("m-model") for _ in range(8)))
    assert [status for status, _ in answers] == [200] * 8
    # replica 0 goes back to sleep when idle: by then a wake asked for replica 1 was taken
    await pool.until("replica 0 asleep again", lambda: (s := pool.status("m")) is not None
                     and s.phase == "Sleeping")
    st = pool.status("m")
    assert st is not None and st.instance is not None
    events = st.as_json()["events"]
    woken = [e["message"] for e in events if e["reason"] == "Woken"]
    assert woken and not [m for m in woken if m.startswith("replica 1:")], events
    one = pool.status("m#1")
    assert one is not None and one.phase == "Sleeping"
    await pool.until("8 access lines", lambda: len(pool.access()) >= 8)
    assert {line["upstream"].split()[0] for line in pool.access()} == {st.instance.agent}


async def test_a_release_at_the_door_puts_every_serving_replica_to_sleep(pool: Pool) -> None:
    """The release route once saw a two-replica claim as two claims (409), and a release
    kept by model name was dropped by the first replica that slept: it is kept per replica."""
    pool.write("m", replicated("m", 2))
    await pool.start(allow_release=True)
    await pool.serving("m", 2)
    assert pool.http is not None
    async with pool.http.post(pool.door + "/v1/models/m-model/release", json={}) as resp:
        body = await resp.json()
        assert resp.status == 200, body
    assert body["released"] is True and body["claim"] == "default/m", body
    assert [s.phase if s else None for s in (pool.status("m"), pool.status("m#1"))] \
        == ["Sleeping", "Sleeping"]
    assert [e["model_name"] for e in pool.engines("m-model").values()] == ["m-model"] * 2
    async with pool.http.post(pool.door + "/v1/models/m-model/release", json={}) as resp:
        again = await resp.json()
    assert resp.status == 200 and again["released"] is False, again


async def test_a_restarted_reconciler_takes_both_replicas_back_without_touching_them(
        pool: Pool) -> None:
    pool.write("m", replicated("m", 2))
    await pool.start()
    await pool.serving("m", 2)
    before = {a: (e["pid"], e["port"], e["claim_ref"]["name"])
              for a, e in pool.engines("m-model").items()}
    placed = {s.name: s.instance.agent for s in (pool.status("m"), pool.status("m#1"))
              if s is not None and s.instance is not None}
    await pool.close()
    again = await pool.start()
    await pool.serving("m", 2)
    assert {s.name: s.instance.agent for s in (pool.status("m"), pool.status("m#1"))
            if s is not None and s.instance is not None} == placed
    assert again.registry.get_sample_value("aibrix_modelclaim_activation_total",
                                           {"result": "success"}) == 0
    assert {a: (e["pid"], e["port"], e["claim_ref"]["name"])
            for a, e in pool.engines("m-model").items()} == before


async def test_a_refused_connection_is_known_never_to_have_reached_the_engine() -> None:
    """What lets the door send a request to another replica: no connection, no request sent
    (``UpstreamUnreachable``), unlike an engine that broke off after the request went out."""
    port = free_port()  # nothing listens there
    async with Upstream(timeout=5) as upstream:
        with pytest.raises(UpstreamUnreachable, match="cannot connect"):
            await upstream.post("127.0.0.1", port, "/v1/completions", {}, b"{}")


async def test_a_queue_at_the_awake_replica_wakes_the_one_asleep_beside_it(pool: Pool) -> None:
    """Replica 1 asleep, replica 0 awake with one slot and 1 s calls, six calls at once: once
    a call would wait at replica 0 longer than replica 1 takes to wake (2 GiB at the seed's
    1 GiB/s), the door wakes replica 1 and the rest go there. Every call once queued at the
    awake replica while the other slept until the idle rule removed it."""
    one_slot = {"--max-num-seqs": "1", "--sim-request-seconds": "1"}
    pool.write("m", replicated("m", 2, **one_slot).replace("6Gi", "2Gi", 1))
    await pool.start()
    await pool.serving("m", 2)
    assert pool.app is not None
    pool.app.deps.books.ask_release("m-model#1", ("default", "m#1"))
    await pool.until("replica 1 asleep, replica 0 serving", lambda: [
        s.phase if s else None for s in (pool.status("m"), pool.status("m#1"))]
        == ["Active", "Sleeping"])
    before = len(pool.access())
    answers = await asyncio.gather(*(pool.chat("m-model") for _ in range(6)))
    assert [status for status, _ in answers] == [200] * 6
    await pool.until("6 more access lines", lambda: len(pool.access()) >= before + 6)
    agents = [line["upstream"].split()[0] for line in pool.access()[before:]]
    assert sorted(set(agents)) == ["agent-a", "agent-b"], agents
    st = pool.status("m#1")
    assert st is not None and st.phase == "Active"
    assert "Woken" in [e["reason"] for e in st.as_json()["events"]]
