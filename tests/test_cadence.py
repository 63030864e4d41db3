"""The probing cadence: fast after any event, backing off to a cap while nothing changes."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contract.clock import LoopClock
from runtime_agent.cadence import Cadence, Pacer, next_interval
from runtime_agent.settings import Settings
from tests.clocks import FakeClock

pytestmark = pytest.mark.loop_guard

STEADY = Cadence(floor_s=1.0, cap_s=5.0)


def test_quiet_looks_double_the_interval_up_to_the_cap() -> None:
    waits, previous = [], None
    for _ in range(6):
        previous = next_interval(STEADY, previous, event=False)
        waits.append(previous)
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_an_event_brings_the_floor_back_at_once() -> None:
    assert next_interval(STEADY, 5.0, event=True) == 1.0
    assert next_interval(STEADY, 5.0, event=False) == 5.0


def test_a_cadence_that_cannot_hold_is_refused() -> None:
    for floor, cap, factor in ((0.0, 1.0, 2.0), (2.0, 1.0, 2.0), (1.0, 2.0, 0.5)):
        with pytest.raises(ValueError, match="need 0 < floor <= cap"):
            Cadence(floor, cap, factor)


cadences = st.builds(
    lambda floor, extra, factor: Cadence(floor, floor + extra, factor),
    st.floats(0.001, 100.0), st.floats(0.0, 1000.0), st.floats(1.0, 10.0))
# A watcher's life: for each look, did it fail, see something new, or was it nudged?
looks = st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), max_size=60)


@given(cadences, looks)
def test_the_interval_stays_within_floor_and_cap_and_any_event_resets_it(
        cadence: Cadence, life: list[tuple[bool, bool, bool]]) -> None:
    interval: float | None = None
    for failed, new, nudged in life:
        interval = next_interval(cadence, interval, event=failed or new or nudged)
        assert cadence.floor_s <= interval <= cadence.cap_s
        if failed or new or nudged:
            assert interval == cadence.floor_s


@given(cadences, st.floats(0.0, 10_000.0, allow_nan=False))
def test_a_failed_probe_always_gets_the_fast_interval(cadence: Cadence, before: float) -> None:
    assert next_interval(cadence, before, event=True) == cadence.floor_s


@given(cadences, st.integers(0, 200))
def test_the_cap_is_reached_and_held_while_nothing_changes(cadence: Cadence, quiet: int) -> None:
    interval: float | None = None
    for _ in range(quiet + 1):
        interval = next_interval(cadence, interval, event=False)
    assert interval is not None
    assert interval == pytest.approx(min(cadence.cap_s, cadence.floor_s * cadence.factor ** quiet))


async def test_a_nudge_during_a_long_wait_brings_the_next_look_within_a_floor() -> None:
    pacer = Pacer(Cadence(floor_s=0.01, cap_s=600.0), LoopClock())
    for _ in range(20):
        pacer.looked(event=False)
    assert pacer.interval_s == 600.0
    waiting = asyncio.create_task(pacer.pause())
    await asyncio.sleep(0)  # the pause has begun its long wait
    pacer.nudge()
    async with asyncio.timeout(10):  # far below the 600 s it would otherwise wait
        await waiting
    pacer.looked(event=False)  # the nudge counts as an event: back to the floor
    assert pacer.interval_s == 0.01


async def test_nudges_never_make_looks_come_faster_than_the_floor() -> None:
    pacer = Pacer(Cadence(floor_s=0.05, cap_s=0.05), LoopClock())
    waiting = asyncio.create_task(pacer.pause())
    for _ in range(5):  # nudges while the last floor is waited change nothing
        pacer.nudge()
        await asyncio.sleep(0)
    assert not waiting.done()
    async with asyncio.timeout(10):
        await waiting


async def test_a_pacer_waits_on_its_clock_not_the_loops() -> None:
    clock = FakeClock(1000.0, stepped=True)
    pacer = Pacer(Cadence(floor_s=1.0, cap_s=8.0), clock)
    for _ in range(3):
        pacer.looked(event=False)
    assert pacer.interval_s == 8.0
    async with asyncio.timeout(5):  # eight seconds on the clock, none on the loop
        await pacer.pause()
    assert clock.asked == [7.0, 1.0] and clock.now() == 1000.0 + 8.0


def test_by_default_scrapes_back_off_by_the_same_factor_as_the_health_probes() -> None:
    """The last look before an idle sleep reads the engine itself (``?fresh=requests``), so a
    steady engine's scrapes need not stay at their floor: 2 s after a change, 20 s at most."""
    settings = Settings()
    assert settings.scrape_cadence == Cadence(floor_s=2.0, cap_s=20.0)
    assert settings.scrape_cadence.cap_s / settings.scrape_interval_s == settings.steady_backoff
