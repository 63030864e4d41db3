"""The fake clock and the per-key failure backoff: the timing ground the controller stands on."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.runtime.ratelimit import ExponentialBackoff, backoff_delay
from tests.clocks import FakeClock

pytestmark = [pytest.mark.timeout(30), pytest.mark.loop_guard]


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


# -- FakeClock ----------------------------------------------------------------------------------

async def test_fake_clock_wakes_sleepers_only_when_their_deadline_is_reached() -> None:
    clock = FakeClock()
    woken: list[str] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woken.append(name)

    tasks = [asyncio.create_task(sleeper("late", 2.0)), asyncio.create_task(sleeper("early", 1.0))]
    await settle()
    assert clock.sleepers == 2 and clock.next_deadline() == 1.0
    clock.advance(0.999)
    await settle()
    assert woken == []
    clock.advance(5.0)
    await settle()
    assert woken == ["early", "late"]
    assert clock.now() == pytest.approx(5.999)
    await asyncio.gather(*tasks)


async def test_fake_clock_forgets_a_cancelled_sleeper() -> None:
    clock = FakeClock()
    task = asyncio.create_task(clock.sleep(1.0))
    await settle()
    task.cancel()
    await settle()
    assert clock.sleepers == 0 and clock.next_deadline() is None
    clock.advance(2.0)  # resolving nothing, raising nothing


async def test_fake_clock_never_goes_back() -> None:
    with pytest.raises(ValueError):
        FakeClock().advance(-1)


# -- ExponentialBackoff ---------------------------------------------------------------------------

def test_a_failing_key_waits_5ms_then_10ms_then_20ms() -> None:
    limiter = ExponentialBackoff()
    assert [limiter.when("k") for _ in range(4)] == [0.005, 0.01, 0.02, 0.04]
    assert limiter.failures("k") == 4


def test_the_delay_is_capped_at_1000_seconds() -> None:
    limiter = ExponentialBackoff()
    delays = [limiter.when("k") for _ in range(30)]
    assert delays[17] == pytest.approx(655.36)
    assert delays[18:] == [1000.0] * 12


def test_forgetting_a_key_starts_its_backoff_again() -> None:
    limiter = ExponentialBackoff()
    for _ in range(5):
        limiter.when("k")
    limiter.forget("k")
    assert limiter.failures("k") == 0
    assert limiter.when("k") == 0.005


def test_an_absurd_failure_count_still_gives_the_cap() -> None:
    assert backoff_delay(10**6) == 1000.0


@given(st.lists(st.sampled_from(["a", "b", "c"]), max_size=80))
def test_keys_back_off_independently_and_monotonically(failing: list[str]) -> None:
    limiter = ExponentialBackoff()
    seen: dict[str, list[float]] = {}
    for key in failing:
        seen.setdefault(key, []).append(limiter.when(key))
    for key, delays in seen.items():
        assert limiter.failures(key) == len(delays)
        assert delays == [min(1000.0, 0.005 * 2**n) for n in range(len(delays))]
        assert all(0.005 <= d <= 1000.0 for d in delays)
        assert delays == sorted(delays)


@given(st.integers(min_value=0, max_value=5000),
       st.floats(min_value=1e-6, max_value=10.0), st.floats(min_value=10.0, max_value=1e6))
def test_backoff_delay_never_exceeds_the_cap_and_never_falls(failures: int, base: float,
                                                           cap: float) -> None:
    delay = backoff_delay(failures, base, cap)
    assert base <= delay <= cap
    assert backoff_delay(failures + 1, base, cap) >= delay
