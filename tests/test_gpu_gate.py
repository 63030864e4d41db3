"""The start gate: declared starts share a card, measured ones have it alone; FIFO among turns
that conflict, no deadlock, cancellable. The bookkeeping (``CardTurns``) is checked by
properties over random sequences of asks and releases; the asyncio gate over it by examples."""

from __future__ import annotations

import asyncio
import random

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_agent.gpu.gate import CardTurns, DeviceGate, Ticket, conflict

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


# ---- shared and exclusive turns --------------------------------------------------------------


async def test_declared_starts_share_a_card_and_a_measured_one_waits_for_all_of_them() -> None:
    gate = DeviceGate()
    a = gate.request([0], shared=True, label="a")
    b = gate.request([0], shared=True, label="b")
    measured = gate.request([0], label="m")
    assert a.granted.done() and b.granted.done() and not measured.granted.done()
    assert gate.holders([0]) == [("a", False), ("b", False)] and gate.waiters(0) == 1
    a.release()
    assert not measured.granted.done()  # b still starts there
    b.release()
    await settle()
    assert measured.granted.done() and gate.holders([0]) == [("m", True)]
    measured.release()
    assert gate.busy() == frozenset()


async def test_a_declared_start_after_a_waiting_measured_one_waits_behind_it() -> None:
    gate = DeviceGate()
    first = gate.request([0], shared=True)
    measured = gate.request([0])
    later = gate.request([0], shared=True)  # may not pass: the measured start would starve
    elsewhere = gate.request([1], shared=True)  # another card: goes at once
    assert not measured.granted.done() and not later.granted.done()
    assert elsewhere.granted.done()
    first.release()
    await settle()
    assert measured.granted.done() and not later.granted.done()
    measured.release()
    await settle()
    assert later.granted.done()
    later.release()
    elsewhere.release()


async def test_a_withdrawn_turn_gives_its_place_to_the_next() -> None:
    gate = DeviceGate()
    held = gate.request([0])
    waiting = gate.request([0])
    behind = gate.request([0], shared=True)
    waiting.release()
    waiting.release()  # twice: harmless
    held.release()
    await settle()
    assert behind.granted.done() and waiting.granted.cancelled()
    behind.release()
    assert gate.busy() == frozenset() and gate.waiters() == 0


# ---- properties of the bookkeeping ----------------------------------------------------------

CARDS = st.frozensets(st.integers(0, 3), min_size=1, max_size=3)
# an action: ask (cards, exclusive), or end the i-th held turn, or withdraw the i-th waiting one
ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("ask"), CARDS, st.booleans()),
    st.tuples(st.just("end"), st.integers(0, 20)),
    st.tuples(st.just("withdraw"), st.integers(0, 20))), max_size=60)


def check(turns: CardTurns, asked: list[Ticket]) -> None:
    """What must hold after every change."""
    held = turns.holding
    # no two holders conflict: a measured start never overlaps another start on its cards
    for i, a in enumerate(held):
        assert not any(conflict(a, b) for b in held[i + 1:])
    # FIFO: no waiter could be granted now (else _grant missed it), and every waiter that could
    # go but for an earlier waiter is behind a conflicting one
    for i, w in enumerate(turns.waiting):
        assert any(conflict(w, h) for h in held) or any(
            conflict(w, e) for e in turns.waiting[:i])
    # no deadlock: the first waiter waits only for a holder, which will end
    if turns.waiting:
        assert any(conflict(turns.waiting[0], h) for h in held)
    # a holder was never granted past an earlier waiter it conflicts with
    order = {id(t): n for n, t in enumerate(asked)}
    for h in held:
        assert not any(conflict(h, w) and order[id(w)] < order[id(h)] for w in turns.waiting)


@settings(max_examples=400)
@given(ACTIONS)
def test_random_asks_and_releases_keep_every_guarantee(actions: list[tuple]) -> None:
    turns = CardTurns()
    asked: list[Ticket] = []
    for action in actions:
        if action[0] == "ask":
            ticket = Ticket(action[1], action[2])
            asked.append(ticket)
            granted = turns.ask(ticket)
        elif action[0] == "end" and turns.holding:
            granted = turns.done(turns.holding[action[1] % len(turns.holding)])
        elif action[0] == "withdraw" and turns.waiting:
            granted = turns.done(turns.waiting[action[1] % len(turns.waiting)])
        else:
            continue
        assert all(t in turns.holding for t in granted)
        check(turns, asked)
    # ending every held turn, in order, drains the queue: nobody waits forever
    for _ in range(len(asked) + 1):
        if not turns.holding:
            break
        turns.done(turns.holding[0])
        check(turns, asked)
    assert turns.holding == [] and turns.waiting == []


@settings(max_examples=200)
@given(st.lists(st.tuples(CARDS, st.booleans()), min_size=1, max_size=30))
def test_exclusive_turns_on_a_card_are_granted_in_the_order_asked(
        asks: list[tuple[frozenset[int], bool]]) -> None:
    turns = CardTurns()
    tickets = [Ticket(cards, exclusive) for cards, exclusive in asks]
    granted: list[Ticket] = []
    for ticket in tickets:
        granted += turns.ask(ticket)
    while turns.holding:
        granted += turns.done(turns.holding[0])
    assert sorted(map(id, granted)) == sorted(map(id, tickets))
    position = {id(t): n for n, t in enumerate(granted)}
    for i, a in enumerate(tickets):
        for b in tickets[i + 1:]:
            if conflict(a, b):  # conflicting turns go in the order they were asked
                assert position[id(a)] < position[id(b)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(CARDS, st.booleans()), min_size=1, max_size=25), st.randoms())
def test_random_shared_and_exclusive_turns_all_finish_and_never_overlap_wrongly(
        jobs: list[tuple[frozenset[int], bool]], rng: random.Random) -> None:
    async def main() -> None:
        gate = DeviceGate()
        exclusive_on: set[int] = set()
        shared_on: dict[int, int] = {}

        async def worker(devices: frozenset[int], shared: bool) -> None:
            async with gate.turn(devices, shared=shared):
                assert not exclusive_on & devices
                if shared:
                    for d in devices:
                        shared_on[d] = shared_on.get(d, 0) + 1
                else:
                    assert not any(shared_on.get(d) for d in devices)
                    exclusive_on.update(devices)
                for _ in range(rng.randint(0, 3)):
                    await asyncio.sleep(0)
                if shared:
                    for d in devices:
                        shared_on[d] -= 1
                else:
                    exclusive_on.difference_update(devices)

        await asyncio.wait_for(asyncio.gather(*(worker(d, not x) for d, x in jobs)), 10)
        assert gate.busy() == frozenset() and gate.waiters() == 0

    asyncio.run(main())
