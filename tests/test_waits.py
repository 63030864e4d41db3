"""The tests' one wait (``tests.waits``): it returns what the check found, and a wait that
gives up says what it waited for and what it saw."""

from __future__ import annotations

import itertools

import pytest

from tests.waits import until, until_blocking

pytestmark = pytest.mark.timeout(10)


async def test_until_returns_the_first_truthy_answer_of_a_blocking_check() -> None:
    answers = iter([None, 0, "found"])
    assert await until("an answer", lambda: next(answers), 5, blocking=True) == "found"


async def test_a_wait_that_gives_up_names_what_it_waited_for_and_what_it_saw() -> None:
    with pytest.raises(AssertionError, match="waiting for the moon; seen: nothing"):
        await until("the moon", lambda: False, 0.1, explain=lambda: "seen: nothing")


def test_the_blocking_wait_polls_until_the_check_holds() -> None:
    count = itertools.count()
    assert until_blocking("three checks", lambda: next(count) >= 3, 5) is True
    with pytest.raises(AssertionError, match="waiting for never"):
        until_blocking("never", lambda: None, 0.1)
