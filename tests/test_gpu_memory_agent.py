"""GPU memory through the real agent: simulated cards fed by simulated engines' allocations."""

from __future__ import annotations

import threading

import psutil
import pytest

from runtime_agent.client import AgentError
from tests.harness import AgentProcess

pytestmark = pytest.mark.integration
GiB, MiB = 2**30, 2**20
CONTEXT = 512 * MiB


def per_gpu(footprint_gib: float, floor_gib: float = 1) -> dict:
    return {"maximum_footprint_bytes": int(footprint_gib * GiB),
            "kv_floor_bytes": int(floor_gib * GiB)}


def weights(gib: float) -> str:
    return f"--sim-memory-bytes={int(gib * GiB)}"


@pytest.fixture
def small_gpu(agent_factory) -> AgentProcess:
    """One 8 GiB card, 1 GiB kept back: 7 GiB usable."""
    return agent_factory(extra_args=["--simulate-gpus", "1x8GiB", "--gpu-reserve", "1GiB",
                                     "--gpu-sample-interval", "0.2"])


def hbm(agent: AgentProcess, name: str, expected: int) -> dict:
    snap = agent.wait_for(lambda s: agent.model(s, name)["hbm_bytes"] == expected,
                          what=f"{name} at {expected} bytes", poll_s=0.05)
    return snap


def test_engine_memory_follows_activate_sleep_wake_and_stop(small_gpu: AgentProcess) -> None:
    agent = small_gpu
    agent.activate_sim("a", weights(2), per_gpu=per_gpu(3))
    agent.wait_phase("a", "active")
    snap = hbm(agent, "a", 2 * GiB + CONTEXT)
    a = agent.model(snap, "a")
    assert a["devices"] == [0] and a["hbm_peak_bytes"] == 2 * GiB + CONTEXT
    assert a["host_rss_bytes"] > 0
    card = snap["accelerators"][0]
    assert card["hbm_total_bytes"] == 8 * GiB and card["hbm_used_by_engines_bytes"] == 2.5 * GiB
    assert card["hbm_free_bytes"] == 8 * GiB - 2.5 * GiB and card["index"] == 0
    assert snap["node"]["host_memory_total_bytes"] == psutil.virtual_memory().total
    agent.client.sleep("a", 1)
    snap = hbm(agent, "a", CONTEXT)  # weights to host memory, KV freed
    a = agent.model(snap, "a")
    assert a["sleeping_footprint_bytes"] == CONTEXT and a["hbm_peak_bytes"] == 2.5 * GiB
    agent.client.wake("a")
    hbm(agent, "a", 2 * GiB + CONTEXT)
    agent.client.deactivate("a")
    snap = agent.wait_for(lambda s: s["accelerators"][0]["hbm_used_bytes"] == 0, poll_s=0.05,
                          what="card free")
    assert snap["accelerators"][0]["hbm_free_bytes"] == 8 * GiB


def test_a_model_too_large_for_every_card_is_refused_at_once(small_gpu: AgentProcess) -> None:
    with pytest.raises(AgentError) as err:
        small_gpu.activate_sim("huge", per_gpu=per_gpu(7))
    assert err.value.status == 400
    body = err.value.body
    assert body["reason"] == "TooLargeForAnyCard"
    assert body["needed_bytes"] == 8 * GiB and "7.0 GiB" in body["message"]
    assert small_gpu.client.snapshot()["models"] == []


def test_a_second_model_that_does_not_fit_is_refused_naming_the_holder(
    small_gpu: AgentProcess,
) -> None:
    agent = small_gpu
    agent.activate_sim("a", weights(3), per_gpu=per_gpu(3))
    agent.wait_phase("a", "active")
    hbm(agent, "a", 3 * GiB + CONTEXT)
    # a sample taken while "a" booted shows its figure but keeps its 4 GiB claim; the first
    # sample of it active replaces the claim by the measurement
    agent.wait_for(lambda s: s["accelerators"][0]["hbm_reserved_bytes"] == 0,
                   what="a's claim replaced by its measurement", poll_s=0.05)
    with pytest.raises(AgentError) as err:
        agent.activate_sim("b", weights(3), per_gpu=per_gpu(3))
    assert err.value.status == 409
    body = err.value.body
    assert body["reason"] == "InsufficientGPUMemory"
    assert body["holders"] == [{"model_name": "a", "bytes": 3 * GiB + CONTEXT}]
    assert "needs 4.0 GiB" in body["message"]


def test_a_waiting_model_starts_when_the_first_one_sleeps(small_gpu: AgentProcess) -> None:
    agent = small_gpu
    agent.activate_sim("a", weights(3), per_gpu=per_gpu(3))
    agent.wait_phase("a", "active")
    hbm(agent, "a", 3 * GiB + CONTEXT)
    result: dict = {}
    waiter = threading.Thread(target=lambda: result.update(agent.activate_sim(
        "b", weights(3), per_gpu=per_gpu(3), wait_seconds=30)))
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive()  # waiting, not refused
    agent.client.sleep("a", 1)
    waiter.join(20)
    assert result["status"] == "success"
    agent.wait_phase("b", "active")


def test_concurrent_activations_that_fit_alone_never_both_start(small_gpu: AgentProcess) -> None:
    agent = small_gpu
    outcomes: list = []

    def activate(name: str) -> None:
        try:
            outcomes.append(agent.activate_sim(name, weights(3), per_gpu=per_gpu(3, 1)))
        except AgentError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=activate, args=(n,)) for n in ("x", "y", "z")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    won = [o for o in outcomes if isinstance(o, dict)]
    lost = [o for o in outcomes if isinstance(o, AgentError)]
    assert len(won) == 1 and len(lost) == 2
    assert all(e.body["reason"] == "InsufficientGPUMemory" for e in lost)
    assert len(agent.client.snapshot()["models"]) == 1


def test_a_level_1_sleep_that_would_overfill_host_memory_is_refused(agent_factory) -> None:
    # Keep all but 512 MiB of host memory out of the budget: no room for 2 GiB of weights.
    reserve = psutil.virtual_memory().total - 512 * MiB
    agent = agent_factory(extra_args=["--simulate-gpus", "1x80GiB", "--host-reserve",
                                      str(reserve)])
    agent.activate_sim("a", weights(2), per_gpu=per_gpu(3))
    agent.wait_phase("a", "active")
    hbm(agent, "a", 2 * GiB + CONTEXT)
    with pytest.raises(AgentError) as err:
        agent.client.sleep("a", 1)
    assert err.value.status == 409 and err.value.body["reason"] == "InsufficientHostMemory"
    assert "level-2" in err.value.body["message"]
    assert agent.client.sleep("a", 2)["phase"] == "sleeping"


def test_starts_on_one_card_take_turns(agent_factory) -> None:
    agent = agent_factory(extra_args=["--simulate-gpus", "1x80GiB"])
    for name in ("a", "b", "c"):
        agent.activate_sim(name, "--sim-startup-seconds=0.4")
    for name in ("a", "b", "c"):
        agent.wait_phase(name, "active")
    events = agent.client.events(0)["events"]
    spans = {}
    for e in events:
        if e["to"] == "booting":
            spans.setdefault(e["model"], [e["ts"], None])
        elif e["to"] == "active":
            spans[e["model"]][1] = e["ts"]
    ordered = sorted(spans.values())
    for (_, end), (start, _) in zip(ordered, ordered[1:], strict=False):
        assert start >= end - 0.001  # the next start waited for the previous one to be ready
