"""Shared fixtures: real agent processes that are always cleaned up, engines included."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.guards import event_loop_guard
from tests.harness import AgentProcess
from tests.owner_fakes import OwnerRig, fast_settings

# The simulator's start, sleep and wake take as long as its model's size says (engines/sim/
# timing.py): right for a person, slow for 1,500 tests. Every process the suite starts inherits
# these (a test's own --sim-* flag still wins): the times the suite was written against.
for _knob, _seconds in (("SIM_STARTUP_SECONDS", "0.5"), ("SIM_SLEEP_SECONDS", "0"),
                        ("SIM_WAKE_SECONDS", "0"), ("SIM_RELOAD_SECONDS", "0")):
    os.environ.setdefault(_knob, _seconds)

# Property tests judge results, not speed: on a loaded 2-core CI machine one slow example must
# not fail a test (hypothesis's default 200 ms deadline and too-slow health check would).
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-loop-guard", action="store_true",
                     help="turn the blocked-event-loop guard off: for runs where the code is "
                          "instrumented and timing says nothing (mutation testing, "
                          "scripts/mutation.sh), so a test fails on a wrong result only")


@pytest.fixture(autouse=True)
async def no_blocking_calls_on_the_event_loop(request: pytest.FixtureRequest
                                              ) -> AsyncIterator[None]:
    """Fails an async test of a module marked ``loop_guard`` (the in-process core: owners,
    gate, ledgers, the reconciler's runtime) in which a callback blocked the event loop (see
    tests/guards.py). Tests that drive simulator processes from their own coroutine block on
    purpose and are not marked."""
    if (request.node.get_closest_marker("loop_guard") is None
            or request.config.getoption("--no-loop-guard")
            or request.node.get_closest_marker("allow_blocking") is not None):
        yield
        return
    async with event_loop_guard():
        yield


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[OwnerRig]:
    """One engine owner's world of fakes (tests/owner_fakes.py), with short restart delays."""
    rig = OwnerRig(tmp_path, fast_settings(tmp_path, restart_delays=(0.01, 0.02, 0.03)))
    yield rig
    await rig.close()


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    made: list[AgentProcess] = []

    def make(state_dir: Path | None = None, start: bool = True, **kwargs: Any) -> AgentProcess:
        agent = AgentProcess(state_dir or tmp_path / f"state{len(made)}", **kwargs)
        made.append(agent)
        if start:
            agent.start()
        return agent

    yield make
    for agent in made:
        agent.cleanup()


@pytest.fixture
def agent(agent_factory: Callable[..., AgentProcess]) -> AgentProcess:
    return agent_factory()
