"""Shared fixtures: real agent processes that are always cleaned up, engines included."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.harness import AgentProcess

# Property tests judge results, not speed: on a loaded 2-core CI machine one slow example must
# not fail a test (hypothesis's default 200 ms deadline and too-slow health check would).
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


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
