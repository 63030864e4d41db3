"""Whole numbers from outside text: one reader, which never raises and never reads more than
plain ASCII digits."""

from __future__ import annotations

import string

from hypothesis import given
from hypothesis import strategies as st

from contract.engines import engine_args_problem
from contract.numbers import MAX_DIGITS, whole_number

TRICKY = st.sampled_from(["\u00b2", "\u0661", "\uff11", "9" * 5000, "9" * MAX_DIGITS,
                          "1" + "0" * MAX_DIGITS, "", " ", " 7 ", "+1", "-1", "1_000", "0x10",
                          "1e3", "007", "0"])


@given(st.one_of(st.text(), TRICKY, st.text(alphabet=string.digits + "\u00b2\u0661 ")))
def test_whole_number_is_int_of_plain_ascii_digits_and_nothing_else(text: str) -> None:
    for strip in (False, True):
        body = text.strip() if strip else text
        plain = 0 < len(body) <= MAX_DIGITS and all(c in string.digits for c in body)
        assert whole_number(text, strip=strip) == (int(body) if plain else None)


@given(st.sampled_from(["--tensor-parallel-size", "--pipeline-parallel-size",
                        "--data-parallel-size"]), st.one_of(st.text(max_size=30), TRICKY))
def test_a_parallel_size_is_judged_without_raising(flag: str, value: str) -> None:
    """The CI failure of 2026-12-01: ``"9" * 5000`` raised ValueError inside activation."""
    problem = engine_args_problem("vllm", {flag: value})
    size = whole_number(value)
    if size is None or size < 1:
        assert problem is not None
