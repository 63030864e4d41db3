"""The reconciler end to end: two real agents (simulated GPUs and engines) and the reconciler in
the test process, driven through manifest files and its HTTP API, checked on the agents."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from reconciler.local.app import ReconcilerApp, Settings
from reconciler.cli import table
from reconciler.context import Timings
from reconciler.status import ClaimStatus
from tests.harness import AgentProcess
from tests.reconciler_fakes import claim_yaml
from tests.waits import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]
ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
CARD = ["--simulate-gpus", "1x16GiB", "--gpu-reserve", "1GiB"]
SIM = {"--sim-startup-seconds": "0.2", "--sim-memory-bytes": str(GiB),
       "--sim-kv-capacity-bytes": str(16 * GiB)}


def sim_claim(name: str, footprint: str = "6Gi", kv_floor: str = "1Gi", **extra: str) -> str:
    return claim_yaml(name, f"{name}-model", footprint, kv_floor, {**SIM, **extra})


class Pool:
    """Two agents, a claims directory, and the reconciler running in this process."""

    def __init__(self, tmp: Path, agents: list[AgentProcess]) -> None:
        self.dir = tmp / "claims"
        self.dir.mkdir()
        self.agents = {f"agent-{'ab'[i]}": a for i, a in enumerate(agents)}
        self.app: ReconcilerApp | None = None

    @classmethod
    def watching(cls, app: ReconcilerApp, claims: Path) -> Pool:
        """A view of a reconciler started elsewhere (embedded mode)."""
        pool = cls.__new__(cls)
        pool.dir, pool.agents, pool.app = claims, {}, app
        return pool

    def write_pool(self, policy: str | None = None, only: str | None = None) -> None:
        listed = "".join(f'\n    - {{name: {n}, url: "{a.url}"}}' for n, a in self.agents.items()
                         if only is None or n == only)
        policy_line = f"\n  policy: {policy}" if policy else ""
        (self.dir / "pool.yaml").write_text(
            "kind: WarmPool\nmetadata:\n  name: pool-a\n  labels: {claim.model.aibrix.ai/pool: "
            f'pool-a, claim.model.aibrix.ai/enabled: "true"}}\nspec:{policy_line}\n  agents:'
            f"{listed}\n")

    def write(self, name: str, text: str) -> None:
        (self.dir / f"{name}.yaml").write_text(text)

    def delete(self, name: str) -> None:
        (self.dir / f"{name}.yaml").unlink()

    async def start(self, status_dir: Path | None = None) -> ReconcilerApp:
        timings = replace(Timings(), kv_resync=1.0)
        self.app = ReconcilerApp(Settings(self.dir, port=0, timings=timings,
                                          status_dir=status_dir))
        await self.app.start()
        return self.app

    def status(self, name: str) -> ClaimStatus | None:
        assert self.app is not None
        return self.app.store.get(("default", name))

    async def until(self, what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
        await until(what, check, timeout, explain=self._claims)

    def _claims(self) -> str:
        states = {s.name: (s.phase, s.reason("Scheduled"), s.reason("Ready"))
                  for s in self.app.store.all()} if self.app else {}
        return f"claims: {states}"

    async def phase(self, name: str, phase: str, timeout: float = 20.0) -> ClaimStatus:
        await self.until(f"{name} {phase}", lambda: (s := self.status(name)) is not None
                         and s.phase == phase, timeout)
        st = self.status(name)
        assert st is not None
        return st

    def engine(self, agent: str, model: str) -> dict[str, Any] | None:
        snap = self.agents[agent].client.snapshot()
        return next((m for m in snap["models"] if m["model_name"] == model), None)

    async def get(self, path: str) -> Any:
        assert self.app is not None
        async with aiohttp.ClientSession() as http:
            async with http.request("POST" if path.endswith("/wake") else "GET",
                                    f"http://127.0.0.1:{self.app.port}{path}") as resp:
                return await resp.json() if "json" in resp.content_type else await resp.text()


@pytest.fixture
def two_agents(agent_factory: Callable[..., AgentProcess]) -> list[AgentProcess]:
    return [agent_factory(restart_delays="0.05", extra_args=CARD) for _ in range(2)]


@pytest.fixture
async def pool(tmp_path: Path, two_agents: list[AgentProcess]) -> AsyncIterator[Pool]:
    made = Pool(tmp_path, two_agents)
    made.write_pool()
    yield made
    if made.app is not None:
        await made.app.stop()


def where(st: ClaimStatus) -> str:
    assert st.instance is not None
    return st.instance.agent


# ---- placement --------------------------------------------------------------------------------


async def test_the_sample_claims_reach_active_and_the_table_shows_them(pool: Pool) -> None:
    text = (ROOT / "samples" / "modelclaim" / "modelclaims.yaml").read_text()
    extra = "".join(f'\n      "{k}": "{v}"' for k, v in SIM.items())
    flag = '--max-model-len: "2048"'
    pool.write("samples", text.replace(flag, flag + extra))
    await pool.start()
    for name in ("qwen3-0-6b", "qwen25-0-5b"):
        st = await pool.phase(name, "Active")
        engine = pool.engine(where(st), st.model_name)
        assert engine is not None and engine["phase"] == "active"
        assert engine["claim_ref"]["name"] == name and engine["claim_ref"]["uid"] == st.uid
    routes = (await pool.get("/v1/routes"))["routes"]
    assert sorted((r["model"], r["state"]) for r in routes) == [("qwen2.5-0.5b", "active"),
                                                                ("qwen3-0.6b", "active")]
    assert all(r["port"] > 0 and r["host"] == "127.0.0.1" for r in routes)
    lines = table((await pool.get("/v1/claims"))["items"]).splitlines()
    assert [line.split()[:6] for line in lines[1:]] == [
        ["qwen25-0-5b", "Active", "1", "1", "vllm", "huggingface://Qwen/Qwen2.5-0.5B-Instruct"],
        ["qwen3-0-6b", "Active", "1", "1", "vllm", "huggingface://Qwen/Qwen3-0.6B"]]


async def test_a_claim_too_large_for_every_card_stays_pending(pool: Pool) -> None:
    pool.write("big", sim_claim("big", footprint="20Gi"))
    await pool.start()
    st = await pool.phase("big", "Pending")
    await pool.until("reason", lambda: st.reason("Scheduled") == "TooLargeForAnyCard")
    assert "largest GPU in the pool has 15.0 GiB" in st.conditions["Scheduled"].message
    assert all(not a.client.snapshot()["models"] for a in pool.agents.values())


async def test_a_claim_with_no_room_names_the_closest_agent_and_takes_a_deleted_claims_room(
        pool: Pool) -> None:
    for name in ("one", "two"):
        pool.write(name, sim_claim(name, footprint="10Gi"))
    await pool.start()
    one, two = await pool.phase("one", "Active"), await pool.phase("two", "Active")
    assert where(one) != where(two)
    pool.write("three", sim_claim("three", footprint="10Gi"))
    three = await pool.phase("three", "Pending")
    await pool.until("unplaced", lambda: three.reason("Scheduled") == "NoMatchingPods")
    assert three.conditions["Scheduled"].message.startswith(
        ("agent-a: needs 11.0 GiB on GPU", "agent-b: needs 11.0 GiB on GPU"))
    freed = where(one)
    pool.delete("one")
    started = time.monotonic()
    await pool.phase("three", "Active")
    assert where(three) == freed and time.monotonic() - started < 8  # at once, not on retry
    assert pool.status("one") is None and pool.engine(freed, "one-model") is None


async def test_claims_without_figures_are_measured_alone_then_placed_by_what_was_measured(
        pool: Pool, tmp_path: Path) -> None:
    """No perGPU and an artifact no one can read here (huggingface://): each is placed on an
    agent no other engine uses, started with no figures, measured by its agent, and then
    carries the measured footprint (recorded in observed-footprints.json); a third waits,
    saying why, and a declared claim fits beside a measured one."""
    strip = re.compile(r"  perGPU:\n    maximumFootprint: \S+\n    kvFloor: \S+\n")
    for name in ("u1", "u2"):
        pool.write(name, strip.sub("", sim_claim(name)))
    (tmp_path / "state" / "status").mkdir(parents=True)
    await pool.start(status_dir=tmp_path / "state" / "status")
    u1, u2 = await pool.phase("u1", "Active"), await pool.phase("u2", "Active")
    assert where(u1) != where(u2)
    for st in (u1, u2):
        assert st.reason("Scheduled") == "Placed"
        await pool.until("measured", lambda st=st: "measured on" in (  # type: ignore[misc]
            st.as_json()["spec"].get("perGPU", {}).get("estimated", "")))
        engine = pool.engine(where(st), st.model_name)
        assert engine is not None and engine["kv_limit_applied_bytes"] is not None
        shown = st.as_json()["spec"]["perGPU"]
        assert shown["kvFloor"] == GiB and 0 < shown["maximumFootprint"] <= 2 * GiB
    book = json.loads((tmp_path / "state" / "observed-footprints.json").read_text())
    assert len(book["footprints"]) == 2
    pool.write("u3", strip.sub("", sim_claim("u3")))
    pool.write("declared", sim_claim("declared", footprint="6Gi"))
    await pool.phase("declared", "Active")
    u3 = await pool.phase("u3", "Pending")
    await pool.until("why", lambda: "measured on GPUs no other engine uses" in
                     u3.conditions["Scheduled"].message)


async def test_kv_limits_are_divided_confirmed_and_sum_within_each_card(pool: Pool) -> None:
    for name in ("p", "q", "r"):
        pool.write(name, sim_claim(name, footprint="3Gi"))
    await pool.start()
    for name in ("p", "q", "r"):
        await pool.phase(name, "Active")

    def divided() -> bool:
        for agent in pool.agents.values():
            models = agent.client.snapshot()["models"]
            if not models:
                continue
            requested = [m["kv_limit_requested_bytes"] for m in models]
            if any(m["kv_limit_applied_bytes"] != m["kv_limit_requested_bytes"]
                   for m in models):
                return False
            # every engine above its floor, all of them within the 15 GiB usable
            if min(requested) <= GiB or sum(requested) + 3 * GiB * len(models) > 15 * GiB:
                return False
            for m in models:  # and the claims' statuses record what the agents confirmed
                st = pool.status(m["model_name"].removesuffix("-model"))
                if st is None or st.instance is None \
                        or st.instance.kv_limit_bytes != m["kv_limit_requested_bytes"]:
                    return False
        return True

    await pool.until("KV limits divided", divided)
    for name in ("p", "q", "r"):
        st = pool.status(name)
        assert st is not None and st.instance is not None
        engine = pool.engine(st.instance.agent, st.model_name)
        assert engine is not None
        assert st.instance.kv_limit_bytes == engine["kv_limit_requested_bytes"]
        assert "KVLimitSet" in [e.reason for e in st.events]


async def test_tensor_parallel_claims_take_two_gpus_of_the_agent_that_has_them(
        tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    one = agent_factory(extra_args=CARD)
    two = agent_factory(extra_args=["--simulate-gpus", "2x16GiB", "--gpu-reserve", "1GiB"])
    pool = Pool(tmp_path, [one, two])
    pool.write_pool()
    tp = {"footprint": "6Gi", "--tensor-parallel-size": "2"}
    try:
        pool.write("tp1", sim_claim("tp1", **tp))
        pool.write("solo", sim_claim("solo", footprint="6Gi"))
        await pool.start()
        tp1, solo = await pool.phase("tp1", "Active"), await pool.phase("solo", "Active")
        assert (where(tp1), where(solo)) == ("agent-b", "agent-a")  # solo: fewest awake
        assert pool.engine("agent-b", "tp1-model")["devices"] == [0, 1]  # type: ignore[index]

        def on_both_gpus() -> bool:  # the agent measures the engine's memory on each card
            cards = two.client.snapshot()["accelerators"]
            return len(cards) == 2 and all(c["hbm_used_by_engines_bytes"] > 0 for c in cards)

        await pool.until("tp1 measured on both GPUs", on_both_gpus)
        pool.write("tp2", sim_claim("tp2", **tp))  # 8 GiB left on each of agent-b's cards
        tp2 = await pool.phase("tp2", "Active")
        assert where(tp2) == "agent-b"
        assert pool.engine("agent-b", "tp2-model")["devices"] == [0, 1]  # type: ignore[index]
        pool.write("tp3", sim_claim("tp3", **tp))  # room for none more: one GPU on agent-a
        tp3 = await pool.phase("tp3", "Pending")
        await pool.until("unplaced", lambda: tp3.reason("Scheduled") == "NoMatchingPods")
        assert tp3.conditions["Scheduled"].message.startswith("agent-b: needs 7.0 GiB on each of 2 GPUs")
    finally:
        if pool.app is not None:
            await pool.app.stop()


# ---- sleep and wake ---------------------------------------------------------------------------


async def test_an_idle_model_sleeps_after_the_policy_time_and_a_wake_request_brings_it_back(
        pool: Pool) -> None:
    pool.write_pool('{"lifecycle": {"sleepAfterSeconds": 2}}')
    pool.write("m", sim_claim("m"))
    await pool.start()
    active = await pool.phase("m", "Active")
    since = time.monotonic()
    await pool.phase("m", "Sleeping", timeout=10)
    # idle counts from the reconciler's first look at it active, a little before `since`
    assert 1.2 < time.monotonic() - since < 5
    assert pool.engine(where(active), "m-model")["phase"] == "sleeping"  # type: ignore[index]
    (route,) = (await pool.get("/v1/routes"))["routes"]
    assert (route["state"], route["port"], route["wakeByRequest"]) == ("sleeping", 0, True)
    # the later requests collapse into the first, or find the model served again already
    answers = [await pool.get("/v1/routes/m-model/wake") for _ in range(3)]
    assert [a["new"] for a in answers] == [True, False, False]
    st = await pool.phase("m", "Active", timeout=10)
    lifecycle = [e.reason for e in st.events if e.reason != "KVLimitSet"]
    assert lifecycle[-3:] == ["Sleeping", "Waking", "Woken"]  # one wake
    (route,) = (await pool.get("/v1/routes"))["routes"]
    assert route["state"] == "active" and route["port"] > 0 and not route["wakeRequested"]


async def test_requests_sent_straight_to_the_engine_keep_it_awake_while_scrapes_back_off(
        tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    # One scrape when the engine is ready, the next 30 s later: the agent's snapshot keeps its
    # first figures (nothing served) throughout, as a steady engine's under
    # --scrape-interval-max; only the last look's read of the engine sees the requests.
    agent = agent_factory(extra_args=[*CARD, "--scrape-interval", "30",
                                      "--scrape-interval-max", "30"])
    pool = Pool(tmp_path, [agent])
    pool.write_pool('{"lifecycle": {"sleepAfterSeconds": 2}}')
    try:
        pool.write("m", sim_claim("m"))
        await pool.start()
        await pool.phase("m", "Active")
        engine = pool.engine("agent-a", "m-model")
        assert engine is not None
        end = time.monotonic() + 7  # past the door, for three times sleepAfterSeconds
        while time.monotonic() < end:
            try:
                await asyncio.to_thread(chat, engine["port"], "m-model")
            except urllib.error.HTTPError as err:  # a sleeping engine answers 503
                pytest.fail(f"put to sleep while requests reached it: {err}")
            st = pool.status("m")
            assert st is not None and st.phase == "Active", [e.reason for e in st.events] \
                if st else None
            await asyncio.sleep(0.5)
        await pool.phase("m", "Sleeping", timeout=15)  # once they stop, it sleeps
    finally:
        if pool.app is not None:
            await pool.app.stop()


async def test_with_no_wake_reserve_room_is_made_by_sleeping_the_longest_idle_model(
        tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory(extra_args=["--simulate-gpus", "1x8GiB", "--gpu-reserve", "1GiB"])
    pool = Pool(tmp_path, [agent])
    pool.write_pool('{"lifecycle": {"noWakeReserveWhileAsleep": true, '
                    '"sleepToMakeRoomAfterSeconds": 1}}')
    small = {"footprint": "2Gi", "kv_floor": "1Gi"}
    try:
        pool.write("first", sim_claim("first", **small))
        await pool.start()
        await pool.phase("first", "Active")
        pool.write("second", sim_claim("second", **small))
        await pool.phase("second", "Active")
        await asyncio.sleep(1.2)  # both idle past sleepToMakeRoomAfterSeconds, first longer
        pool.write("third", sim_claim("third", **small))  # 7 GiB usable: no room for a third
        await pool.phase("third", "Active")
        first = pool.status("first")
        assert first is not None and first.phase == "Sleeping"
        assert "SleptToMakeRoom" in [e.reason for e in first.events]
        await asyncio.sleep(1.0)
        await pool.get("/v1/routes/first-model/wake")
        await pool.phase("first", "Active", timeout=15)
        second = pool.status("second")
        assert second is not None and second.phase == "Sleeping"
        assert "SleptToMakeRoom" in [e.reason for e in second.events]
        third = pool.status("third")
        assert third is not None and third.phase == "Active", \
            [(e.reason, e.message) for e in third.events] if third else None
    finally:
        if pool.app is not None:
            await pool.app.stop()


# ---- failures and deletion --------------------------------------------------------------------


@pytest.fixture
def crashing_a(agent_factory: Callable[..., AgentProcess],
               monkeypatch: pytest.MonkeyPatch) -> Iterator[list[AgentProcess]]:
    """agent-a's engines crash 2.5 s after each start (SIM_CRASH_AFTER in its environment, which
    engines inherit: long enough for the test to see the claim Active there); agent-b's do not.
    One restart each (restart delays 0.05)."""
    monkeypatch.setenv("SIM_CRASH_AFTER", "2.5")
    a = agent_factory(restart_delays="0.05", extra_args=CARD)
    monkeypatch.delenv("SIM_CRASH_AFTER")
    b = agent_factory(restart_delays="0.05", extra_args=CARD)
    yield [a, b]


async def test_an_engine_crashing_past_its_restart_budget_moves_to_the_other_agent(
        tmp_path: Path, crashing_a: list[AgentProcess]) -> None:
    pool = Pool(tmp_path, crashing_a)
    pool.write_pool()
    pool.write("m", sim_claim("m"))
    try:
        await pool.start()
        st = await pool.phase("m", "Active")
        assert where(st) == "agent-a"  # both empty: the first by name
        await pool.until("moved to agent-b", lambda: st.phase == "Active"
                         and where(st) == "agent-b", timeout=30)
        reasons = [e.reason for e in st.events]
        assert reasons.index("EngineFailed") < reasons.index("Rescheduled")
        assert pool.engine("agent-a", "m-model") is None
    finally:
        if pool.app is not None:
            await pool.app.stop()


def chat(port: int, model: str) -> None:
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}' % model.encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()


async def test_a_deleted_claim_leaves_the_route_finishes_its_requests_then_stops(
        pool: Pool) -> None:
    # The request outlasts everything the test waits on before it looks at the engine, with
    # room for a loaded machine (seeing it running takes a scrape; leaving the route a turn).
    pool.write("m", sim_claim("m", **{"--sim-request-seconds": "8"}))
    await pool.start()
    st = await pool.phase("m", "Active")
    agent, port = where(st), st.instance.port  # type: ignore[union-attr]
    answered: list[bool] = []
    request = threading.Thread(target=lambda: answered.append(chat(port, "m-model") is None))
    request.start()
    await pool.until("a request in progress", lambda: (pool.engine(agent, "m-model") or {})
                     .get("requests_running") == 1.0, timeout=10)
    deleted = time.monotonic()
    pool.delete("m")
    await pool.until("off the route", lambda: st.deleted is not None, timeout=10)
    assert (await pool.get("/v1/routes"))["routes"] == []
    assert request.is_alive()  # in flight still: its engine must keep serving it
    assert pool.engine(agent, "m-model")["phase"] == "active"  # type: ignore[index]
    await pool.until("stopped", lambda: pool.status("m") is None, timeout=30)
    assert 1.5 < time.monotonic() - deleted < 30  # it waited for the request, not the 90 s
    await asyncio.to_thread(request.join, 30)
    assert answered == [True]  # the request was answered (urlopen raises on an error)
    assert pool.engine(agent, "m-model") is None


async def test_an_invalid_pool_policy_is_reported_and_ignored(pool: Pool) -> None:
    pool.write_pool('{"lifecycle": {"sleepAfterSeconds": 1, "unknown": true}}')
    pool.write("m", sim_claim("m"))
    await pool.start()
    await pool.phase("m", "Active")
    problems = (await pool.get("/v1/claims"))["problems"]
    assert [p["reason"] for p in problems] == ["InvalidPoolPolicy"]
    assert 'aibrix_modelclaim_pool_policy_valid{namespace="default",pool="pool-a"} 0.0' in \
        await pool.get("/metrics")
    await asyncio.sleep(2.0)
    assert pool.status("m").phase == "Active"  # type: ignore[union-attr]





async def test_a_restarted_reconciler_takes_its_claims_back_without_touching_the_engines(
        pool: Pool) -> None:
    pool.write("m", sim_claim("m"))
    app = await pool.start()
    st = await pool.phase("m", "Active")
    engine = pool.engine(where(st), "m-model")
    assert engine is not None
    await app.stop()
    again = await pool.start()
    st2 = await pool.phase("m", "Active")
    assert st2 is not st and st2.uid == st.uid and where(st2) == where(st)
    assert again.registry.get_sample_value("aibrix_modelclaim_activation_total",
                                           {"result": "success"}) == 0
    after = pool.engine(where(st2), "m-model")
    assert after is not None and (after["pid"], after["port"]) == (engine["pid"], engine["port"])


# ---- run modes and CLI --------------------------------------------------------------------------


async def test_the_embedded_reconciler_makes_its_agent_the_pool_and_the_cli_reads_it(
        tmp_path: Path, agent_factory: Callable[..., AgentProcess],
        capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from reconciler.local.embedded import start_embedded
    from reconciler.cli import add_commands

    agent = agent_factory(extra_args=CARD)
    claims = tmp_path / "claims"
    claims.mkdir()
    (claims / "m.yaml").write_text(sim_claim("m"))
    handle = await start_embedded(agent.url, claims, "127.0.0.1", 0)
    try:
        await Pool.watching(handle, claims).phase("m", "Active")
        parser = argparse.ArgumentParser()
        add_commands(parser.add_subparsers(dest="command", required=True))
        url = f"http://127.0.0.1:{handle.port}"
        for argv in (["claims", "get", "--url", url], ["claims", "describe", "m", "--url", url]):
            args = parser.parse_args(argv)
            assert await asyncio.to_thread(args.func, args) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[1].split()[:4] == ["m", "Active", "1", "1"]
        assert "ModelClaimActive" in out and "Activated" in out
    finally:
        await handle.stop()
    assert (claims / ".status" / "default_m.json").is_file()
