"""The start gate: one start or wake per card at a time, FIFO, no deadlock, cancellable."""

from __future__ import annotations

import asyncio
import random

import pytest

from runtime_agent.gpu.gate import DeviceGate

pytestmark = pytest.mark.loop_guard  # the in-process core must not block its loop


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_one_turn_per_card_and_fifo_order() -> None:
    gate = DeviceGate()
    order: list[str] = []
    release = {name: asyncio.Event() for name in "abc"}

    async def start(name: str) -> None:
        async with gate.turn([0]):
            order.append(name)
            await release[name].wait()

    tasks = []
    for name in "abc":
        tasks.append(asyncio.create_task(start(name)))
        await settle()
    assert order == ["a"] and gate.waiters() == 2 and gate.waiters(0) == 2
    assert gate.busy() == {0}
    for name in "abc":
        release[name].set()
        await settle()
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c"] and gate.waiters() == 0 and gate.busy() == frozenset()


async def test_disjoint_cards_do_not_wait_for_each_other() -> None:
    gate = DeviceGate()
    hold = asyncio.Event()
    inside: set[int] = set()

    async def start(device: int) -> None:
        async with gate.turn([device]):
            inside.add(device)
            await hold.wait()

    tasks = [asyncio.create_task(start(d)) for d in range(4)]
    await settle()
    assert inside == {0, 1, 2, 3} and gate.waiters() == 0
    hold.set()
    await asyncio.gather(*tasks)


async def test_a_later_turn_may_pass_a_waiting_one_only_on_other_cards() -> None:
    gate = DeviceGate()
    hold0, hold_tp = asyncio.Event(), asyncio.Event()
    entered: list[str] = []

    async def run(name: str, devices: list[int], hold: asyncio.Event) -> None:
        async with gate.turn(devices):
            entered.append(name)
            await hold.wait()

    first = asyncio.create_task(run("first", [0], hold0))
    await settle()
    tp = asyncio.create_task(run("tp", [0, 1], hold_tp))  # waits for card 0
    await settle()
    on1 = asyncio.create_task(run("on1", [1], asyncio.Event()))  # card 1 is wanted by tp: waits
    on2 = asyncio.create_task(run("on2", [2], hold0))  # nobody wants card 2: goes at once
    await settle()
    assert entered == ["first", "on2"] and gate.waiters() == 2
    assert not gate.busy() & {1}  # tp waits without holding card 1
    hold0.set()
    await settle()
    assert entered == ["first", "on2", "tp"]
    hold_tp.set()
    await settle()
    assert entered[-1] == "on1"
    on1.cancel()
    await asyncio.gather(first, tp, on2, return_exceptions=True)
    await asyncio.gather(on1, return_exceptions=True)


async def test_cancelling_a_waiter_lets_the_next_one_in() -> None:
    gate = DeviceGate()
    hold = asyncio.Event()
    entered: list[str] = []

    async def run(name: str, devices: list[int]) -> None:
        async with gate.turn(devices):
            entered.append(name)
            await hold.wait()

    a = asyncio.create_task(run("a", [0]))
    await settle()
    b = asyncio.create_task(run("b", [0, 1]))
    await settle()
    c = asyncio.create_task(run("c", [1]))
    await settle()
    assert entered == ["a"] and gate.waiters() == 2
    b.cancel()
    await settle()
    assert entered == ["a", "c"] and gate.waiters() == 0
    with pytest.raises(asyncio.CancelledError):
        await b
    hold.set()
    await asyncio.gather(a, c)
    assert gate.busy() == frozenset()


async def test_a_turn_granted_while_being_cancelled_is_given_back() -> None:
    gate = DeviceGate()
    first = gate.turn([0])
    await first.__aenter__()
    waiter = asyncio.create_task(_enter_and_hold(gate, [0]))
    await settle()
    await first.__aexit__(None, None, None)  # grants the waiter's future...
    waiter.cancel()  # ...and cancels it before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.busy() == frozenset() and gate.waiters() == 0
    async with gate.turn([0]):
        pass


async def _enter_and_hold(gate: DeviceGate, devices: list[int]) -> None:
    async with gate.turn(devices):
        await asyncio.sleep(10)


async def test_the_turn_is_released_when_the_body_fails() -> None:
    gate = DeviceGate()
    with pytest.raises(RuntimeError):
        async with gate.turn([0, 1]):
            raise RuntimeError("start failed")
    assert gate.busy() == frozenset()


async def test_an_empty_card_set_needs_no_turn() -> None:
    gate = DeviceGate()
    async with gate.turn([0]):
        async with gate.turn([]):
            assert gate.busy() == {0}


async def test_random_overlapping_turns_never_share_a_card_and_all_finish() -> None:
    gate = DeviceGate()
    rng = random.Random(7)
    in_use: set[int] = set()

    async def worker(devices: list[int]) -> None:
        async with gate.turn(devices):
            assert not in_use & set(devices)
            in_use.update(devices)
            await asyncio.sleep(rng.random() / 1000)
            in_use.difference_update(devices)

    jobs = [sorted(rng.sample(range(4), rng.randint(1, 3)), reverse=rng.random() < 0.5)
            for _ in range(200)]
    await asyncio.wait_for(asyncio.gather(*(worker(j) for j in jobs)), timeout=30)
    assert gate.busy() == frozenset() and gate.waiters() == 0
