"""The last look before an idle sleep reads request figures fresh (``?fresh=requests``), against
the real agent and simulated engines with scrapes backed off: a request sent straight to the
engine shows at once, an engine that does not answer is never reported with its old figures,
and however many callers ask at once, one engine call is in flight per engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from engines.driver import Observation
from runtime_agent.client import AgentError
from runtime_agent.supervision.messages import Message
from runtime_agent.supervision.owner.look import FreshLook
from tests.harness import AgentProcess, http_json

pytestmark = pytest.mark.timeout(60)
# One scrape when the engine is ready, the next 30 s later: every figure after the first is
# stale, as a steady engine's are under --scrape-interval-max.
BACKED_OFF = ("--scrape-interval", "30", "--scrape-interval-max", "30")


def _observed(agent: AgentProcess, name: str) -> dict[str, Any]:
    agent.activate_sim(name)
    agent.wait_phase(name, "active")
    snap = agent.wait_for(lambda s: agent.model(s, name)["request_metrics_observed"],
                          timeout_s=20, what=f"{name}'s first scrape", poll_s=0.1)
    return agent.model(snap, name)


def _fresh(agent: AgentProcess, *names: str) -> dict[str, Any]:
    query = "&".join(f"model={n}" for n in names)
    return agent.client.get(f"/v1/runtime/snapshot?fresh=requests&{query}")


@pytest.mark.integration
def test_a_request_sent_straight_to_the_engine_shows_in_the_fresh_look_while_scrapes_back_off(
        agent_factory) -> None:
    agent: AgentProcess = agent_factory(extra_args=BACKED_OFF)
    entry = _observed(agent, "m1")
    assert entry["request_success_total"] == 0
    status, body = http_json(f"http://127.0.0.1:{entry['port']}/v1/completions", "POST",
                             {"model": "m1", "prompt": "hi", "max_tokens": 1}, timeout=10)
    assert status == 200, body
    plain = agent.model(agent.client.snapshot(), "m1")
    assert plain["request_success_total"] == 0  # the scrape's figure: 30 s until the next
    asked = time.time()
    fresh = agent.model(_fresh(agent, "m1"), "m1")
    assert fresh["request_metrics_observed"] is True and fresh["request_figures_fresh"] is True
    assert fresh["request_success_total"] == 1
    assert fresh["requests_running"] == 0 and fresh["requests_waiting"] == 0
    assert fresh["request_figures_at"] >= time.strftime("%Y-%m-%dT%H:%M:%S",
                                                        time.gmtime(int(asked)))
    # The owner took the reading as a scrape's: the plain snapshot shows it too now.
    after = agent.wait_for(lambda s: agent.model(s, "m1")["request_success_total"] == 1,
                           timeout_s=5, what="the reading in the plain snapshot", poll_s=0.05)
    assert agent.model(after, "m1")["request_metrics_observed"] is True


@pytest.mark.integration
def test_an_engine_that_does_not_answer_the_fresh_look_is_not_observed_never_stale(
        agent_factory) -> None:
    agent: AgentProcess = agent_factory(extra_args=BACKED_OFF)
    engine = _observed(agent, "m1")
    _observed(agent, "m2")
    os.kill(engine["pid"], signal.SIGSTOP)  # alive, answers nothing
    try:
        began = time.monotonic()
        snap = _fresh(agent)  # every engine
        took = time.monotonic() - began
        hung, other = agent.model(snap, "m1"), agent.model(snap, "m2")
        assert hung["request_metrics_observed"] is False, hung
        assert hung["request_figures_fresh"] is False
        assert hung["request_success_total"] is None and hung["requests_running"] == 0
        assert other["request_metrics_observed"] is True and other["request_figures_fresh"]
        assert took < 2 * 2.0 + 3.0, took  # bounded by the probe timeout (2 s), not hung
        # The plain snapshot still carries the last scrape's figure, with its time.
        plain = agent.model(agent.client.snapshot(), "m1")
        assert "request_figures_fresh" not in plain and plain["request_figures_at"]
    finally:
        os.kill(engine["pid"], signal.SIGCONT)


@pytest.mark.integration
def test_a_fresh_look_at_an_unknown_model_or_of_an_unknown_kind_is_refused_with_what_to_fix(
        agent_factory) -> None:
    agent: AgentProcess = agent_factory(extra_args=BACKED_OFF)
    with pytest.raises(AgentError) as unknown:
        _fresh(agent, "nope")
    assert unknown.value.status == 404 and "'nope' is not on this agent" in str(unknown.value)
    with pytest.raises(AgentError) as kind:
        agent.client.get("/v1/runtime/snapshot?fresh=everything")
    assert kind.value.status == 400 and "fresh must be one of requests" in str(kind.value)


class _Engine:
    """An engine whose /metrics answer waits for the test: records when each call began."""

    def __init__(self) -> None:
        self.calls = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.gate = asyncio.Event()

    async def observe(self, timeout_s: float) -> Observation | None:
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        number = self.calls
        await self.gate.wait()
        self.in_flight -= 1
        return Observation(running=0, waiting=0, success_total=number)


async def test_callers_who_ask_during_a_look_share_the_next_one_and_never_take_an_older_one(
        ) -> None:
    engine = _Engine()
    posted: list[Message] = []
    look = FreshLook(engine, 2.0, posted.append, lambda: 1)  # type: ignore[arg-type]
    first = asyncio.create_task(look(lambda: True))
    await asyncio.sleep(0)  # the first look's call is in flight
    later = [asyncio.create_task(look(lambda: True)) for _ in range(50)]
    await asyncio.sleep(0)
    engine.gate.set()
    answers = await asyncio.gather(first, *later)
    assert answers[0] is not None and answers[0].success_total == 1
    # Every later caller got the call begun after they asked (the second), none the first.
    assert {a.success_total for a in answers[1:] if a is not None} == {2}
    assert engine.calls == 2 and engine.most_in_flight == 1
    assert len(posted) == 2  # the owner took both readings as scrapes
