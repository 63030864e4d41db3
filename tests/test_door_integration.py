"""The front door end to end: a real agent (simulated GPU and engines, separate processes), the
reconciler and its door in the test process, and clients over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from reconciler.local.app import ReconcilerApp, Settings
from reconciler.door.settings import DoorSettings
from reconciler.status import ClaimStatus
from tests.harness import AgentProcess, free_port
from tests.reconciler_fakes import claim_yaml
from tests.waits import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
GiB = 1 << 30
CARD = ["--simulate-gpus", "1x16GiB", "--gpu-reserve", "1GiB"]
SIM = {"--sim-startup-seconds": "0.2", "--sim-memory-bytes": str(GiB),
       "--sim-kv-capacity-bytes": str(16 * GiB)}
SLEEPY = '{"lifecycle": {"sleepAfterSeconds": 1}}'
CHAT = [{"role": "user", "content": "Say hello."}]


def claim(name: str, footprint: str = "3Gi", engine: str = "vllm",
          artifact: str | None = None, model: str | None = None, **args: str) -> str:
    return claim_yaml(name, model or name, footprint, "1Gi", {**SIM, **args}, engine=engine,
                      artifact=artifact)


class Door:
    """One agent, a claims directory, the reconciler and its door in this process."""

    def __init__(self, tmp: Path, agent: AgentProcess) -> None:
        self.tmp = tmp
        self.agent = agent
        self.dir = tmp / "claims"
        self.dir.mkdir()
        self.app: ReconcilerApp | None = None
        self.http: aiohttp.ClientSession | None = None

    def pool(self, policy: str | None = None) -> None:
        line = f"\n  policy: {policy}" if policy else ""
        (self.dir / "pool.yaml").write_text(
            "kind: WarmPool\nmetadata:\n  name: pool-a\n  labels: {claim.model.aibrix.ai/pool: "
            f'pool-a, claim.model.aibrix.ai/enabled: "true"}}\nspec:{line}\n  agents:\n'
            f'    - {{name: agent-a, url: "{self.agent.url}"}}\n')

    def write(self, name: str, text: str) -> None:
        (self.dir / f"{name}.yaml").write_text(text)

    async def start(self, **door: Any) -> ReconcilerApp:
        settings = DoorSettings(port=0, access_log=str(self.tmp / "access.log"), **door)
        self.app = ReconcilerApp(Settings(self.dir, port=0, door=settings))
        await self.app.start()
        self.http = aiohttp.ClientSession()
        return self.app

    @property
    def url(self) -> str:
        assert self.app is not None and self.app.door is not None
        return f"http://127.0.0.1:{self.app.door.port}"

    def status(self, name: str) -> ClaimStatus | None:
        assert self.app is not None
        return self.app.store.get(("default", name))

    async def until(self, what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
        await until(what, check, timeout)

    async def phase(self, name: str, phase: str, timeout: float = 30.0) -> None:
        await self.until(f"{name} {phase}", lambda: (s := self.status(name)) is not None
                         and s.phase == phase, timeout)

    async def post(self, path: str, body: Mapping[str, Any],
                   headers: Mapping[str, str] | None = None) -> tuple[int, Any, Any]:
        assert self.http is not None
        async with self.http.post(self.url + path, json=body, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers

    async def chat(self, model: str, **extra: Any) -> tuple[int, Any, Any]:
        return await self.post("/v1/chat/completions",
                               {"model": model, "messages": CHAT, "max_tokens": 4, **extra})

    async def metrics(self) -> str:
        assert self.http is not None and self.app is not None
        async with self.http.get(f"http://127.0.0.1:{self.app.port}/metrics") as resp:
            return await resp.text()

    def access(self) -> list[dict[str, Any]]:
        path = self.tmp / "access.log"
        return [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []

    async def logged(self, count: int) -> dict[str, Any]:
        """The access log's last line once it has ``count`` (lines are written in batches)."""
        await self.until(f"{count} access lines", lambda: len(self.access()) >= count, 5)
        return self.access()[-1]

    def wakes(self, model: str) -> int:
        events = self.agent.client.events(0)["events"]
        return sum(1 for e in events if e["model"] == model and e["reason"] == "Woken")

    def engine(self, model: str) -> dict[str, Any]:
        return self.agent.model(self.agent.client.snapshot(), model)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
        if self.app is not None:
            await self.app.stop()


@pytest.fixture
async def door(tmp_path: Path,
               agent_factory: Callable[..., AgentProcess]) -> AsyncIterator[Door]:
    made = Door(tmp_path, agent_factory(restart_delays="0.05", extra_args=CARD))
    yield made
    await made.close()


def metric(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{") and line.split("}")[0][len(name) + 1:] == want:
            return float(line.rsplit(" ", 1)[1])
    return None


async def asleep(door: Door, name: str, **args: str) -> None:
    """Claim ``name`` placed, Active, then asleep after a second idle."""
    door.write(name, claim(name, **args))
    await door.phase(name, "Active")
    await door.phase(name, "Sleeping")


# ---- wake and hold ------------------------------------------------------------------------------


async def test_a_request_to_a_sleeping_model_answers_200_after_one_wake(door: Door) -> None:
    door.pool(SLEEPY)
    await door.start()
    await asleep(door, "m", **{"--sim-wake-seconds": "0.3"})
    status, body, _ = await door.chat("m")
    assert status == 200, body
    assert body["model"] == "m" and body["choices"][0]["message"]["content"]
    assert door.wakes("m") == 1
    line = await door.logged(1)
    assert (line["model"], line["status"], line["held_for"], line["claim"]) == (
        "m", 200, "wake", "default/m")
    assert line["held_ms"] >= 300 and line["completion_tokens"] == 4
    text = await door.metrics()
    assert metric(text, "aibrix:door_wakes_requested_total", model="m") == 1.0
    assert metric(text, "aibrix:door_held_seconds_count", model="m", cause="wake") == 1.0
    assert metric(text, "aibrix:door_requests_total", model="m", endpoint="chat",
                  code="200") == 1.0


async def test_a_hundred_concurrent_requests_to_a_sleeping_model_make_one_wake(
        door: Door) -> None:
    door.pool(SLEEPY)
    await door.start()
    await asleep(door, "m", **{"--sim-wake-seconds": "1"})
    answers = await asyncio.gather(*(door.chat("m", user=str(i)) for i in range(100)))
    assert [status for status, _, _ in answers] == [200] * 100
    assert door.wakes("m") == 1
    text = await door.metrics()
    assert metric(text, "aibrix:door_wakes_requested_total", model="m") == 1.0
    assert metric(text, "aibrix:door_held_seconds_count", model="m", cause="wake") == 100.0


async def test_a_request_for_a_model_without_room_makes_room_and_succeeds(door: Door) -> None:
    door.pool('{"lifecycle": {"sleepAfterSeconds": 600, "noWakeReserveWhileAsleep": true, '
              '"sleepToMakeRoomAfterSeconds": 2}}')
    await door.start()
    for name in ("a", "b"):  # room 6 + 1 GiB each: two fit in the 15 usable, not three
        door.write(name, claim(name, footprint="6Gi"))
        await door.phase(name, "Active")
    door.write("c", claim("c", footprint="6Gi"))
    await door.phase("c", "Pending")  # no room yet: a and b idle less than 2 s
    status, body, _ = await door.chat("c")
    assert status == 200, body
    slept = [n for n in ("a", "b") if (s := door.status(n)) is not None and s.phase == "Sleeping"]
    assert len(slept) == 1
    st = door.status(slept[0])
    assert st is not None and "SleptToMakeRoom" in [e.reason for e in st.events]
    assert (await door.logged(1))["held_for"] == "room"


async def test_a_queue_over_its_bound_gets_503_with_retry_after(door: Door) -> None:
    door.pool(SLEEPY)
    await door.start(max_held=3)
    await asleep(door, "m", **{"--sim-wake-seconds": "3"})
    held = [asyncio.ensure_future(door.chat("m")) for _ in range(3)]
    assert door.app is not None and door.app.door is not None
    ledger = door.app.door.ledger
    await door.until("three held", lambda: ledger.held("m") == 3, 10)
    started = time.monotonic()
    status, body, headers = await door.chat("m")
    assert time.monotonic() - started < 1.0  # at once, not after the wake
    assert status == 503 and headers["Retry-After"] == "10"
    assert body["error"]["code"] == "queue_full" and "3 requests already wait" in \
        body["error"]["message"]
    assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200, 200]


async def test_a_disconnecting_client_frees_its_slot(door: Door) -> None:
    door.pool()
    await door.start(max_held=1)
    door.write("big", claim("big", footprint="10Gi"))
    await door.phase("big", "Active")
    door.write("other", claim("other", footprint="10Gi"))  # no room, nothing may sleep for it
    await door.until("other unplaced", lambda: (s := door.status("other")) is not None
                     and s.reason("Scheduled") == "NoMatchingPods")
    assert door.app is not None and door.app.door is not None
    ledger = door.app.door.ledger
    async with aiohttp.ClientSession() as leaving:
        request = asyncio.ensure_future(leaving.post(
            door.url + "/v1/chat/completions", json={"model": "other", "messages": CHAT}))
        await door.until("held", lambda: ledger.held("other") == 1, 10)
        status, body, _ = await door.chat("other")
        assert status == 503 and body["error"]["code"] == "queue_full"
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
    await door.until("the slot freed", lambda: ledger.held("other") == 0
                     and ledger.in_flight("other") == 0, 10)
    await door.until("logged", lambda: any(
        line["error"] == "client_disconnected" for line in door.access()), 10)
    again = asyncio.ensure_future(door.chat("other"))
    await door.until("held again", lambda: ledger.held("other") == 1, 10)
    assert not again.done()
    again.cancel()


# ---- streaming ----------------------------------------------------------------------------------


async def stream(door: Door, model: str, tokens: int) -> tuple[list[tuple[float, bytes]], int]:
    """SSE events of a streamed chat and the time each arrived, as the client reads them."""
    assert door.http is not None
    events: list[tuple[float, bytes]] = []
    async with door.http.post(door.url + "/v1/chat/completions", json={
            "model": model, "messages": CHAT, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        buffer = b""
        async for chunk in resp.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                events.append((time.monotonic(), event))
        return events, resp.status


async def test_a_stream_arrives_token_by_token_and_keeps_its_model_awake(door: Door) -> None:
    door.pool(SLEEPY)
    await door.start()
    door.write("m", claim("m", **{"--sim-token-seconds": "0.15"}))
    await door.phase("m", "Active")
    events, status = await stream(door, "m", 16)  # ~2.3 s: past sleepAfterSeconds
    assert status == 200 and events[-1][1] == b"data: [DONE]"
    tokens = [t for t, e in events if b'"content": "' in e and b'"content": ""' not in e]
    assert len(tokens) == 16
    gaps = [b - a for a, b in zip(tokens, tokens[1:], strict=False)]
    assert min(gaps) > 0.05 and tokens[-1] - tokens[0] > 1.5, gaps  # not buffered
    st = door.status("m")
    assert st is not None and "Sleeping" not in [e.reason for e in st.events]
    line = await door.logged(1)
    assert line["stream"] is True and line["ttft_ms"] < 1000
    assert (line["prompt_tokens"], line["completion_tokens"]) == (3, 16)  # "user: Say hello."
    assert metric(await door.metrics(), "aibrix:door_time_to_first_token_seconds_count",
                  model="m") == 1.0
    await door.phase("m", "Sleeping")  # idle now: it sleeps


async def test_a_broken_upstream_ends_the_stream_with_an_error_event(door: Door) -> None:
    door.pool()
    await door.start()
    door.write("m", claim("m", **{"--sim-token-seconds": "0.2"}))
    await door.phase("m", "Active")
    pid = door.engine("m")["pid"]
    assert door.http is not None
    async with door.http.post(door.url + "/v1/completions", json={
            "model": "m", "prompt": "count", "max_tokens": 50, "stream": True}) as resp:
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")
        os.killpg(pid, signal.SIGKILL)
        rest = await asyncio.wait_for(resp.content.read(), 10)
    events = [e for e in rest.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_error" and "broke off" in error["message"]
    assert (await door.logged(1))["error"] == "upstream_broken"


# ---- the context window, engines of another kind, keys ----------------------------------------


async def test_an_over_long_prompt_is_refused_with_openais_shape(door: Door) -> None:
    door.pool()
    await door.start()
    door.write("m", claim("m", **{"--max-model-len": "64"}))
    await door.phase("m", "Active")
    long_text = " ".join(["word"] * 300)
    status, body, _ = await door.post("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": long_text}]})
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == "messages"
    assert "maximum context length is 64 tokens" in body["error"]["message"]
    assert "resulted in 301 tokens" in body["error"]["message"]  # the engine's own count
    status, body, _ = await door.post("/v1/completions", {"model": "m", "prompt": long_text})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert door.engine("m")["request_success_total"] in (0, 0.0, None)  # never reached it
    status, _, _ = await door.chat("m")
    assert status == 200


async def test_a_request_a_sleeping_model_cannot_hold_is_refused_without_waking_it(
        door: Door) -> None:
    """The prompt is counted by the sleeping engine's own tokenizer and the output limit read
    from the request: both refusals come before any wake, in the door's shape only."""
    door.pool(SLEEPY)
    await door.start()
    await asleep(door, "m", **{"--max-model-len": "64"})
    long_text = " ".join(["word"] * 300)
    status, body, _ = await door.post("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": long_text}]})
    assert status == 400, body
    assert (body["error"]["code"], body["error"]["param"]) == ("context_length_exceeded",
                                                               "messages")
    assert "resulted in 301 tokens" in body["error"]["message"]  # the engine's count, asleep
    assert door.wakes("m") == 0
    for field, endpoint, extra in (
            ("max_tokens", "/v1/chat/completions", {"messages": CHAT}),
            ("max_completion_tokens", "/v1/chat/completions", {"messages": CHAT}),
            ("max_tokens", "/v1/completions", {"prompt": "Say hello."})):
        status, body, _ = await door.post(endpoint, {"model": "m", field: 65, **extra})
        assert status == 400, body
        assert body["error"] == {
            "message": "This model's maximum context length is 64 tokens. However, you "
                       "requested 65 tokens for the completion alone. Please reduce the number "
                       "of tokens requested for the completion.",
            "type": "invalid_request_error", "param": field, "code": "context_length_exceeded"}
    assert door.wakes("m") == 0
    assert door.engine("m")["phase"] == "sleeping"
    assert door.status("m").phase == "Sleeping"  # type: ignore[union-attr]
    # A limit that fits the context but not after the prompt is vLLM's to shorten, not refused.
    status, body, _ = await door.chat("m", max_tokens=64)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= 64


async def test_an_ollama_engine_is_reached_through_the_same_door(door: Door) -> None:
    door.pool()
    await door.start()
    door.write("q", claim("q", engine="ollama", artifact="ollama://qwen3:0.6b",
                          model="qwen3-0-6b", **{"--context-length": "4096"}))
    door.write("m", claim("m"))
    await door.phase("q", "Active")
    await door.phase("m", "Active")
    status, body, _ = await door.chat("qwen3-0-6b")
    assert status == 200, body
    assert body["system_fingerprint"] == "fp_ollama" and body["model"] == "qwen3:0.6b"
    assert body["choices"][0]["message"]["content"]
    status, body, _ = await door.chat("m")
    assert status == 200 and body["model"] == "m"
    events, status = await stream(door, "qwen3-0-6b", 3)
    assert status == 200 and events[-1][1] == b"data: [DONE]"
    assert door.http is not None
    async with door.http.get(door.url + "/v1/models") as resp:
        listed = {m["id"]: m for m in (await resp.json())["data"]}
    assert listed["qwen3-0-6b"]["max_model_len"] == 4096 and listed["m"]["max_model_len"] == 2048
    assert listed["qwen3-0-6b"]["state"] == "active"
    async with door.http.get(door.url + "/v1/models/qwen3-0-6b") as resp:
        assert (await resp.json())["root"] == "ollama://qwen3:0.6b"
    async with door.http.get(door.url + "/v1/models/nope") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"


async def test_api_keys_guard_the_door_and_limit_keys_to_their_models(door: Door,
                                                                     tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-everything-1\nsk-only-a-model a\n")
    door.pool()
    await door.start(api_keys=keys)
    for name in ("a", "b"):
        door.write(name, claim(name))
        await door.phase(name, "Active")
    status, body, _ = await door.chat("a")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer sk-not-a-key"}
    status, body, _ = await door.post("/v1/chat/completions", {"model": "a", "messages": CHAT},
                                      wrong)
    assert status == 401
    only_a = {"Authorization": "Bearer sk-only-a-model"}
    status, body, _ = await door.post("/v1/chat/completions", {"model": "b", "messages": CHAT},
                                      only_a)
    assert status == 403 and body["error"]["code"] == "model_not_allowed"
    status, body, _ = await door.post("/v1/chat/completions", {"model": "a", "messages": CHAT},
                                      only_a)
    assert status == 200
    status, body, _ = await door.post("/v1/chat/completions", {"model": "zzz",
                                                               "messages": CHAT}, only_a)
    assert status == 404 and "Models served here: a." in body["error"]["message"]
    assert door.http is not None
    async with door.http.get(door.url + "/v1/models", headers=only_a) as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["a"]
    async with door.http.get(door.url + "/healthz") as resp:
        assert resp.status == 200  # no key needed
    assert (await door.logged(5))["key"].startswith("sha256:")


async def test_only_the_engines_model_routes_are_reachable_through_the_door(door: Door) -> None:
    door.pool()
    await door.start()
    door.write("m", claim("m"))
    await door.phase("m", "Active")
    assert door.http is not None
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("POST", "/v1/load_lora_adapter"),
                         ("GET", "/metrics"), ("GET", "/sim/state"), ("GET", "/v1/routes")):
        async with door.http.request(method, door.url + path) as resp:
            assert resp.status in (404, 405), path
            body = await resp.json()
            assert body["error"]["message"].startswith("No such endpoint") or \
                resp.status == 405
    status, body, _ = await door.post("/v1/chat/completions", {"messages": CHAT})
    assert status == 400 and body["error"]["param"] == "model"


# ---- the README's first command ---------------------------------------------------------------


async def test_serve_with_claims_opens_the_door_and_keeps_engines_on_loopback(
        tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    (claims / "m.yaml").write_text(claim("m"))
    agent = agent_factory(engine_host=None, free_ports=["--claims-port", "--door-port"],
                          extra_args=[*CARD, "--claims", str(claims)])
    door_port, claims_port = agent.ports["--door-port"], agent.ports["--claims-port"]
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{door_port}/v1/chat/completions",
                             json={"model": "m", "messages": CHAT}) as resp:
            assert resp.status == 200, await resp.text()  # held while the engine started
        async with http.get(f"http://127.0.0.1:{claims_port}/metrics") as resp:
            text = await resp.text()
    assert metric(text, "aibrix:door_requests_total", model="m", endpoint="chat",
                  code="200") == 1.0
    engine = psutil.Process(agent.model(agent.client.snapshot(), "m")["pid"])
    listening = {(c.laddr.ip, c.laddr.port) for c in engine.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN}
    assert listening == {("127.0.0.1", agent.model(agent.client.snapshot(), "m")["port"])}


async def test_a_reconciler_whose_door_cannot_listen_leaves_nothing_running(
        tmp_path: Path) -> None:
    """A start that fails at the door (its port in use) stops what it had started: the agents'
    session (no "Unclosed client session" at exit), the feeds, the controllers, the server."""
    import gc
    import socket

    from reconciler.local.embedded import start_embedded

    def open_sessions() -> set[int]:  # the sync client's shared one is open before and after
        gc.collect()
        return {id(o) for o in gc.get_objects()
                if isinstance(o, aiohttp.ClientSession) and not o.closed}

    (tmp_path / "claims").mkdir()
    before = set(asyncio.all_tasks())
    sessions = open_sessions()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            await start_embedded(f"http://127.0.0.1:{free_port()}", tmp_path / "claims",
                                 listen_port=0, door=DoorSettings(port=taken.getsockname()[1]))
    await asyncio.sleep(0)  # tasks cancelled by the stop finish
    assert set(asyncio.all_tasks()) - before == set()
    assert open_sessions() - sessions == set()


async def test_a_lora_adapter_loaded_on_an_engine_is_served_through_the_door(
        tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    adapter = tmp_path / "sql-lora"
    adapter.mkdir()
    door = Door(tmp_path, agent_factory(restart_delays="0.05", extra_args=[
        *CARD, "--artifact-local-root", str(tmp_path)]))
    try:
        door.pool()
        await door.start()
        door.write("base", claim("base", **{"--enable-lora": ""}))
        await door.phase("base", "Active")
        status, body, _ = await door.chat("sql")
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert door.http is not None
        async with door.http.post(door.agent.url + "/v1/lora_adapter/load", json={
                "lora_name": "sql", "lora_path": str(adapter)}) as resp:
            assert resp.status == 200, await resp.text()
        deadline = time.monotonic() + 10  # the door asks engines again at most once a second
        while (answer := await door.chat("sql"))[0] == 404 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert answer[0] == 200, answer[1]
        await door.until("the answer logged", lambda: any(
            line["status"] == 200 for line in door.access()), 5)
        line = [line for line in door.access() if line["status"] == 200][-1]
        assert (line["model"], line["claim"]) == ("base", "default/base")  # counted as its claim
        async with door.http.get(door.url + "/v1/models") as resp:
            cards = {m["id"]: m for m in (await resp.json())["data"]}
        assert cards["sql"]["parent"] == "base" and cards["base"]["parent"] is None
    finally:
        await door.close()
