"""The owner's parts alone: the liveness verdict, the operation slot, LoRA's plans, the clock.

Each part keeps its own fields; what ties them together is written once and checked here,
without a loop around it (the owner's behaviour is ``test_owner*.py``).
"""

from __future__ import annotations

import asyncio

from contract.clock import LoopClock
from contract.phases import Phase
from registry.record import EngineRecord, EngineSpec, LoraAdapter
from runtime_agent.supervision.durability import StorageHealth
from runtime_agent.supervision.messages import (
    Action,
    AdapterDone,
    LoadAdapter,
    Request,
    Sleep,
    Wake,
)
from runtime_agent.supervision.outcomes import Done, Refused
from runtime_agent.supervision.owner.liveness import Liveness, Verdict
from runtime_agent.supervision.owner.lora import Call, Lora
from runtime_agent.supervision.owner.slots import OperationSlot, ProcessSlot


def test_misses_make_an_engine_unresponsive_once_then_killed_after_the_grace() -> None:
    live = Liveness(after=3, grace_s=10)
    assert live.missed(2, now=100) == Verdict() and not live.unresponsive
    verdict = live.missed(3, now=100)
    assert verdict.event is not None and "3 health probes" in verdict.event and live.unresponsive
    assert live.missed(4, now=105) == Verdict()  # told once, not at every miss
    assert live.missed(5, now=110) == Verdict(kill="unresponsive: no answer to its health "
                                              "probe for 10 s")
    assert live.answered() and not live.unresponsive and not live.answered()


async def test_failing_an_operation_answers_its_own_request_first_then_the_deferred() -> None:
    ops = OperationSlot()
    loop = asyncio.get_running_loop()
    own, later = (Request(intent, loop.create_future()) for intent in (Sleep(1), Wake()))
    task = asyncio.create_task(asyncio.sleep(3600))
    ops.start(task, "sleep", own)
    ops.defer(later)
    assert ops.busy and ops.action == "sleep" and ops.next_deferred() is None  # still in flight
    assert ops.fail_all() == [own, later]
    await asyncio.sleep(0)
    assert task.cancelled() and not ops.busy and ops.next_deferred() is None


async def test_deferred_requests_drain_one_at_a_time_once_nothing_is_in_flight() -> None:
    ops = OperationSlot()
    loop = asyncio.get_running_loop()
    first, second = (Request(Wake(), loop.create_future()) for _ in range(2))
    ops.start(asyncio.create_task(asyncio.sleep(0)), "wake", None)
    ops.defer(first)
    ops.defer(second)
    ops.finish()
    assert ops.next_deferred() is first
    ops.start(asyncio.create_task(asyncio.sleep(0)), "wake", first)
    assert ops.next_deferred() is None  # the drain stops while the next one runs
    ops.finish()
    assert ops.next_deferred() is second and ops.next_deferred() is None


def test_news_from_a_process_that_was_replaced_or_released_is_not_current() -> None:
    procs = ProcessSlot()
    gen = procs.attach(object())  # type: ignore[arg-type]
    assert procs.current(gen)
    procs.release()
    assert not procs.current(gen) and procs.proc is None
    assert procs.cause("exited with code 1") == "exited with code 1"


async def test_the_loop_clock_runs_a_callback_after_its_delay_and_not_once_cancelled() -> None:
    clock = LoopClock()
    ran: list[str] = []
    fired = asyncio.Event()
    start = clock.now()
    clock.later(0.01, lambda: (ran.append("due"), fired.set()))
    clock.later(0.0, lambda: ran.append("cancelled")).cancel()
    await asyncio.wait_for(fired.wait(), 5)
    assert ran == ["due"] and clock.now() - start >= 0.01 and clock.wall() > 1.6e9


class PlanLoop:
    """Just enough of ``OwnerLoop`` for LoRA's plans, which read the loop and write nothing."""

    def __init__(self, record: EngineRecord, phase: Phase) -> None:
        self.record, self.phase, self.name, self.generation = record, phase, "m1", 1


def lora_for(phase: Phase, *adapters: LoraAdapter) -> Lora:
    spec = EngineSpec(model_name="m1", artifact_url="hf://org/m", engine="vllm",
                      ipc_name="kvc_m1", args={"--enable-lora": ""})
    record = EngineRecord(engine_id="e" * 16, spec=spec, port=20000, created_at=1.0,
                          last_transition=1.0, adapters=list(adapters))
    return Lora(PlanLoop(record, phase), OperationSlot(), ProcessSlot(),  # type: ignore[arg-type]
                None, StorageHealth(), None)  # type: ignore[arg-type]


def test_a_lora_load_is_written_first_then_called_or_kept_for_the_wake() -> None:
    awake = lora_for(Phase.ACTIVE, LoraAdapter(name="sql", path="/a/sql"))
    plan = awake.plan_load(LoadAdapter("chat", "/a/chat"))
    assert [a.name for a in plan.adapters or []] == ["sql", "chat"] and plan.answer is None
    assert plan.call == Call(Action.LOAD_ADAPTER, "chat", "/a/chat")
    asleep = lora_for(Phase.SLEEPING).plan_load(LoadAdapter("chat", "/a/chat"))
    assert asleep.call is None and isinstance(asleep.answer, Done)
    assert asleep.answer.details["in_force"] is False
    clash = awake.plan_load(LoadAdapter("sql", "/elsewhere"))
    assert clash.adapters is None and isinstance(clash.answer, Refused)


def test_a_lora_load_the_engine_refused_is_no_longer_desired_and_told() -> None:
    lora = lora_for(Phase.ACTIVE, LoraAdapter(name="sql", path="/a/sql"))
    plan = lora.plan_done(AdapterDone(1, Action.LOAD_ADAPTER, "sql", "no such path", 400, None))
    assert plan.adapters == [] and plan.answer is None
    assert plan.events == (("AdapterLoadFailed", "sql: no such path"),)
    assert not lora.serves("sql")
