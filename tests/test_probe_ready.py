"""Readiness of a started engine (``runtime_agent.supervision.watchers.probe_ready``).

The readiness probe is the health probe: its one request carries the engine's word on sleep
(vLLM's ``/is_sleeping``), so a fresh vLLM engine is ready on its first answer. Only a driver
whose preparing did something (Ollama loads its model) is asked its word again afterwards.
"""

from __future__ import annotations

import asyncio

from engines.client import EngineCallError
from runtime_agent.settings import Settings
from runtime_agent.supervision import watchers
from runtime_agent.supervision.messages import Message, Ready, Unusable
from tests.clocks import FakeClock


class Recording:
    """A driver that answers from scripts and writes down each call."""

    kind = "recording"

    def __init__(self, answers: list[tuple[bool, bool | None]], prepared: bool,
                 asked_word: bool | None = None, prepare_error: str | None = None) -> None:
        self.answers, self.prepared = list(answers), prepared
        self.asked_word, self.prepare_error = asked_word, prepare_error
        self.calls: list[str] = []

    async def probe(self, timeout_s: float, asleep: bool) -> tuple[bool, bool | None]:
        self.calls.append(f"probe(asleep={asleep})")
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    async def prepare(self, timeout_s: float) -> bool:
        self.calls.append("prepare")
        if self.prepare_error is not None:
            raise EngineCallError(self.prepare_error)
        return self.prepared

    async def is_sleeping(self, timeout_s: float) -> bool | None:
        self.calls.append("is_sleeping")
        return self.asked_word


def run(driver: Recording, prepare: bool, asleep: bool = False) -> list[Message]:
    posted: list[Message] = []
    clock = FakeClock(stepped=True)
    asyncio.run(watchers.probe_ready(driver, Settings(), posted.append, 7,  # type: ignore[arg-type]
                                     prepare, clock, asleep))
    return posted


def test_a_fresh_vllm_engine_is_ready_on_its_first_answer_with_its_word_on_sleep() -> None:
    driver = Recording([(False, None), (False, None), (True, False)], prepared=False)
    assert run(driver, prepare=True) == [Ready(7, False)]
    assert driver.calls == ["probe(asleep=False)"] * 3 + ["prepare"]  # no second round trip


def test_a_readopted_sleeping_engine_is_probed_as_asleep_and_keeps_its_word() -> None:
    driver = Recording([(True, True)], prepared=False)
    assert run(driver, prepare=False, asleep=True) == [Ready(7, True)]
    assert driver.calls == ["probe(asleep=True)"]


def test_an_engine_whose_preparing_did_something_is_asked_its_word_again() -> None:
    # Ollama: /api/ps answered "not loaded" (asleep) before the load; loaded after it
    driver = Recording([(True, True)], prepared=True, asked_word=False)
    assert run(driver, prepare=True) == [Ready(7, False)]
    assert driver.calls == ["probe(asleep=False)", "prepare", "is_sleeping"]


def test_a_failed_preparation_makes_the_engine_unusable_and_asks_nothing_more() -> None:
    driver = Recording([(True, None)], prepared=True, prepare_error="model load refused")
    [message] = run(driver, prepare=True)
    assert isinstance(message, Unusable) and message.gen == 7
    assert "start-up failed: model load refused" in message.why
    assert driver.calls == ["probe(asleep=False)", "prepare"]
