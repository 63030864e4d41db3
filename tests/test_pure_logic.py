"""Pure decisions: restart backoff, probe delays, phase table, names, ports, engine arguments."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contract.phases import Phase, TransitionError, allowed, check_transition
from engines import vllm
from engines.client import parse_request_figures
from runtime_agent.supervision.backoff import (
    DEFAULT_RESTART_DELAYS,
    probe_delays,
    restart_delay,
)
from runtime_agent.supervision.ports import choose_port


def test_the_restart_schedule_is_the_seeds_and_ends_after_five() -> None:
    got = [restart_delay(n, DEFAULT_RESTART_DELAYS) for n in range(7)]
    assert got == [2.0, 4.0, 8.0, 16.0, 32.0, None, None]


@given(st.lists(st.floats(0, 100), max_size=8), st.integers(0, 20))
def test_restart_delay_follows_any_configured_schedule(delays: list[float], n: int) -> None:
    expected = delays[n] if n < len(delays) else None
    assert restart_delay(n, delays) == expected


def test_a_negative_restart_count_is_a_bug() -> None:
    with pytest.raises(ValueError):
        restart_delay(-1, DEFAULT_RESTART_DELAYS)


@given(st.floats(0.001, 1), st.floats(1, 3), st.floats(1, 10))
def test_probe_delays_start_at_first_grow_and_never_pass_the_cap(
    first: float, factor: float, cap_mult: float
) -> None:
    cap = first * cap_mult
    delays = list(itertools.islice(probe_delays(first, factor, cap), 50))
    assert delays[0] == first
    assert all(a <= b for a, b in itertools.pairwise(delays))
    assert max(delays) <= cap


def test_every_phase_can_be_stopped_and_stopped_is_terminal() -> None:
    for phase in Phase:
        if phase not in (Phase.STOPPING, Phase.STOPPED):
            assert allowed(phase, Phase.STOPPING)
    assert not any(allowed(Phase.STOPPED, p) for p in Phase)
    assert allowed(Phase.STOPPING, Phase.STOPPED)


def test_a_failed_engine_leaves_failed_only_by_a_stop_or_a_new_activation() -> None:
    assert [p for p in Phase if allowed(Phase.FAILED, p)] == [Phase.RESTARTING, Phase.STOPPING]
    with pytest.raises(TransitionError):
        check_transition(Phase.FAILED, Phase.ACTIVE)


def test_an_engine_becomes_active_only_from_booting_or_sleeping() -> None:
    assert {p for p in Phase if allowed(p, Phase.ACTIVE)} == {Phase.BOOTING, Phase.SLEEPING}


@given(st.sets(st.integers(100, 120)))
def test_the_chosen_port_is_the_lowest_free_one(held: set[int]) -> None:
    port = choose_port(100, 120, held, lambda p: True)
    free = [p for p in range(100, 121) if p not in held]
    assert port == (free[0] if free else None)


def test_a_port_something_else_listens_on_is_skipped() -> None:
    assert choose_port(100, 105, {100}, lambda p: p != 101) == 102


def test_vllm_argv_puts_agent_flags_first_and_values_as_separate_items() -> None:
    argv = vllm.build_argv(["vllm", "serve"], "huggingface://Qwen/Qwen3-0.6B", "qwen3-0.6b",
                           "0.0.0.0", 20000, {"--max-model-len": "2048", "--enforce-eager": "",
                                              "--chat-template": "a b; rm -rf /"})
    assert argv == ["vllm", "serve", "Qwen/Qwen3-0.6B", "--served-model-name", "qwen3-0.6b",
                    "--host", "0.0.0.0", "--port", "20000", "--enable-sleep-mode",
                    "--disable-access-log-for-endpoints", "/health,/is_sleeping,/metrics",
                    "--max-model-len", "2048", "--enforce-eager", "--chat-template",
                    "a b; rm -rf /"]


def test_request_figures_sum_vllm_series_over_labels() -> None:
    text = """# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{reason="x"} 9.0
vllm:request_success_total{finished_reason="stop",model_name="m"} 10.0
vllm:request_success_total{finished_reason="length",model_name="m"} 5.0
vllm:request_success_created{finished_reason="stop",model_name="m"} 1.7e9
"""
    figures = parse_request_figures(text)
    assert figures is not None
    assert (figures.running, figures.waiting, figures.success_total) == (3, 4, 15)
    assert all(type(v) is int for v in (figures.running, figures.waiting, figures.success_total))


def test_an_exposition_without_the_series_observes_nothing() -> None:
    assert parse_request_figures("") is None
    assert parse_request_figures("# HELP x y\nprocess_cpu_seconds_total 3.0\n") is None


def test_a_malformed_series_line_observes_nothing_rather_than_wrong_figures() -> None:
    assert parse_request_figures('vllm:num_requests_running{model_name="m" 2.0\n') is None
