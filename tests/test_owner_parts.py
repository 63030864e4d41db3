"""The owner's parts alone: the pure liveness verdict, the operation slot's rules, the clock.

Each part keeps its own fields; what ties them together is written once and checked here,
without a loop around it (the owner's behaviour is ``test_owner*.py``).
"""

from __future__ import annotations

import asyncio

from contract.clock import LoopClock
from runtime_agent.supervision.messages import Request, Sleep, Wake
from runtime_agent.supervision.owner.liveness import Liveness, Verdict
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
