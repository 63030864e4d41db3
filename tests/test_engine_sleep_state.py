"""vLLM's ``vllm:engine_sleep_state`` read as a sleep level: the engine's word on which sleep."""

from __future__ import annotations

import pytest

from engines.client import parse_sleep_level

pytestmark = pytest.mark.timeout(10)


def page(awake: float, offloaded: float, discarded: float) -> str:
    """The gauge as vLLM writes it (one series per state, 1 on the current one)."""
    rows = (("awake", awake), ("weights_offloaded", offloaded), ("discard_all", discarded))
    return "\n".join(
        ["# HELP vllm:engine_sleep_state Engine sleep state", "# TYPE vllm:engine_sleep_state gauge",
         'vllm:num_requests_running{engine="0",model_name="m"} 0.0']
        + [f'vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="{s}"}} {v}'
           for s, v in rows]) + "\n"


@pytest.mark.parametrize(("values", "level"), [((1.0, 0.0, 0.0), 0), ((0.0, 1.0, 0.0), 1),
                                               ((0.0, 0.0, 1.0), 2)])
def test_the_series_at_one_names_the_level(values: tuple[float, float, float], level: int) -> None:
    assert parse_sleep_level(page(*values)) == level


@pytest.mark.parametrize("text", [
    'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n',  # an engine without the gauge
    page(0.0, 1.0, 1.0),  # two states at once: not an answer
    page(0.0, 0.0, 0.0),
    'vllm:engine_sleep_state{sleep_state="awake" 1\n',  # malformed
])
def test_a_page_that_does_not_say_one_level_says_none(text: str) -> None:
    assert parse_sleep_level(text) is None
