"""Shared fixtures: real agent processes that are always cleaned up, engines included."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import AgentProcess


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
