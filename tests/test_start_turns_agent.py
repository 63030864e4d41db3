"""Starts on shared cards through the real agent and simulated engines (issue 26, item 2).

Engines that declared their footprint start at once on a card while the ledger admits them;
engines that declared nothing start one at a time per card (each is measured alone), and cards
go on in parallel. An activation answers at once: a start that waits for its card says so
(``activating``, reason ``StartQueued``) instead of holding its caller. Everything is read from
the agent's events feed: the order of ``booting`` and ``active`` events, not wall-clock limits.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import AgentProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
GiB = 2**30
WEIGHTS = f"--sim-memory-bytes={256 * 2**20}"
DECLARED = {"maximum_footprint_bytes": GiB, "kv_floor_bytes": GiB}


def spans(agent: AgentProcess) -> dict[str, tuple[float, float]]:
    """Each engine's start: from its ``booting`` event to its ``active`` one."""
    begun: dict[str, float] = {}
    ended: dict[str, float] = {}
    for e in agent.client.events(0)["events"]:
        if e["to"] == "booting" and e["from"] != "booting":
            begun.setdefault(e["model"], e["ts"])
        elif e["to"] == "active" and e["from"] == "booting":
            ended.setdefault(e["model"], e["ts"])
    return {m: (begun[m], ended[m]) for m in begun if m in ended}


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def cards(agent: AgentProcess, names: list[str]) -> dict[str, list[int]]:
    snap = agent.client.snapshot()
    return {n: agent.model(snap, n)["devices"] for n in names}


def test_declared_starts_share_a_card_and_measured_ones_start_alone_on_each_card(
        agent_factory: Any) -> None:
    agent: AgentProcess = agent_factory(extra_args=["--simulate-gpus", "2x80GiB"])
    declared = [f"d{i}" for i in range(4)]
    measured = [f"m{i}" for i in range(4)]
    for name in declared:
        agent.activate_sim(name, "--sim-startup-seconds=1.5", WEIGHTS, per_gpu=DECLARED)
    for name in declared:
        agent.wait_phase(name, "active", timeout_s=60)
    for name in measured:
        agent.activate_sim(name, "--sim-startup-seconds=0.6", WEIGHTS)
    for name in measured:
        agent.wait_phase(name, "active", timeout_s=60)
    span, where = spans(agent), cards(agent, declared + measured)
    by_card: dict[int, list[str]] = {}
    for name, devices in where.items():
        by_card.setdefault(devices[0], []).append(name)
    assert sorted(by_card) == [0, 1]  # spread over both cards (worst fit)
    for card, names in by_card.items():
        on_card = [n for n in names if n in declared]
        assert len(on_card) == 2, where
        # every declared start on this card was booting while the others were
        assert overlap(span[on_card[0]], span[on_card[1]]), (card, span)
        alone = [n for n in names if n in measured]
        assert len(alone) == 2, where
        for m in alone:  # a measured start overlaps no other start on its card
            assert not any(overlap(span[m], span[o]) for o in names if o != m), (card, span)
    # the two cards went on in parallel: some measured start on card 0 overlaps one on card 1
    zero = [span[n] for n in by_card[0] if n in measured]
    one = [span[n] for n in by_card[1] if n in measured]
    assert any(overlap(a, b) for a in zero for b in one), span


def test_activations_one_after_another_answer_while_the_card_is_busy(
        agent_factory: Any) -> None:
    agent: AgentProcess = agent_factory(extra_args=["--simulate-gpus", "1x80GiB"])
    first = agent.activate_sim("first", "--sim-startup-seconds=4", WEIGHTS)
    assert first["phase"] == "booting" and first["pid"]  # a free card: started at once
    answers = [agent.activate_sim(f"next{i}", "--sim-startup-seconds=0.2", WEIGHTS)
               for i in range(3)]
    # each answered while 'first' was still being measured: queued, and why
    for answer in answers:
        assert answer["phase"] == "activating" and answer["pid"] is None, answer
        assert answer["reason"] == "StartQueued" and "queued" in answer["message"], answer
    events = agent.client.events(0)["events"]
    assert not any(e["model"] == "first" and e["to"] == "active" for e in events), (
        "an activation waited for the busy card instead of answering")
    queued = [e for e in events if e["reason"] == "StartQueued"]
    assert [e["model"] for e in queued] == ["next0", "next1", "next2"]
    assert all("'first' is starting there" in e["message"] for e in queued[:1]), queued
    snap = agent.client.snapshot()
    assert "StartQueued" in agent.model(snap, "next2")["conditions"]
    for name in ("first", "next0", "next1", "next2"):
        agent.wait_phase(name, "active", timeout_s=60)
    order = sorted(spans(agent).items(), key=lambda kv: kv[1][0])
    assert [name for name, _ in order] == ["first", "next0", "next1", "next2"]  # FIFO
    for (_, a), (_, b) in zip(order, order[1:], strict=False):
        assert not overlap(a, b)
    assert "StartQueued" not in agent.model(agent.client.snapshot(), "next2")["conditions"]
