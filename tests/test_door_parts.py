"""The door's small parts: the context window rule, API keys, usage found in answers, the
ledger and its change signal."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guard.access import bearer
from reconciler.door.keys import KeyFile, KeysError, parse_keys
from reconciler.door.ledger import Changes, Ledger
from reconciler.door.proxy import usage_of
from reconciler.door.window import (
    context_from_args,
    estimate,
    exceeded,
    needs_count,
    output_limit,
    prompt_of,
    refusal_message,
)

pytestmark = pytest.mark.timeout(30)


# ---- the context window -------------------------------------------------------------------


def test_a_body_no_longer_than_the_context_in_bytes_is_never_counted() -> None:
    assert not needs_count(4096, 4096)
    assert needs_count(4097, 4096)
    assert not needs_count(10**6, None)  # an unknown context never refuses


def test_the_output_limit_is_read_as_vllm_reads_it() -> None:
    assert output_limit("chat", {"max_completion_tokens": 9, "max_tokens": 3}) == (
        "max_completion_tokens", 9)
    assert output_limit("chat", {"max_completion_tokens": None, "max_tokens": 3}) == (
        "max_tokens", 3)
    assert output_limit("completion", {"max_completion_tokens": 9}) is None
    assert output_limit("completion", {"max_tokens": 5}) == ("max_tokens", 5)
    assert output_limit("chat", {"max_tokens": True}) is None  # the engine refuses it itself
    assert output_limit("chat", {"max_tokens": "7"}) is None
    assert output_limit("embedding", {"max_tokens": 5}) is None


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)


@given(st.sampled_from(("chat", "completion", "embedding", "other")),
       st.dictionaries(st.sampled_from(("max_tokens", "max_completion_tokens", "x")), JSON))
def test_any_request_document_gives_an_output_limit_or_none(endpoint: str,
                                                            doc: dict[str, object]) -> None:
    found = output_limit(endpoint, doc)
    assert found is None or (found[0] in doc and doc[found[0]] == found[1]
                             and type(found[1]) is int)


def test_the_prompt_of_a_chat_is_its_messages_rendered_by_the_engine() -> None:
    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]}
    p = prompt_of("chat", doc, "upstream")
    assert p is not None and p.param == "messages" and p.token_ids is None
    assert p.tokenize_body == {"model": "upstream", "messages": doc["messages"],
                               "add_generation_prompt": True, "tools": [{"x": 1}]}


def test_a_batch_is_counted_by_its_longest_prompt_and_token_ids_count_themselves() -> None:
    p = prompt_of("completion", {"prompt": ["a", "a much longer prompt", "bb"]}, "m")
    assert p is not None and p.tokenize_body == {"model": "m", "prompt": "a much longer prompt"}
    ids = prompt_of("embedding", {"input": [[1, 2, 3], [4, 5]]}, "m")
    assert ids is not None and ids.token_ids == 3 and ids.param == "input"
    assert prompt_of("embedding", {"input": 7}, "m") is None


def test_the_refusal_says_the_limit_and_the_count_as_openai_does() -> None:
    assert refusal_message(5000, 4096, "messages") == (
        "This model's maximum context length is 4096 tokens. However, your messages resulted "
        "in 5000 tokens. Please reduce the length of the messages.")
    assert exceeded(4097, 4096) and not exceeded(4096, 4096) and not exceeded(None, 10)


def test_the_declared_context_comes_from_the_engine_kinds_own_flag() -> None:
    assert context_from_args("vllm", {"--max-model-len": "2048"}) == 2048
    assert context_from_args("sglang", {"--context-length": "8192"}) == 8192
    assert context_from_args("ollama", {"--context-length": "4096"}) == 4096
    assert context_from_args("ollama", {"--max-model-len": "4096"}) is None
    assert context_from_args("vllm", {"--max-model-len": "auto"}) is None
    assert estimate("x" * 35) == 10


# ---- API keys -----------------------------------------------------------------------------


def test_keys_are_read_with_their_model_lists_and_comments() -> None:
    keys = parse_keys("# the team keys\nsk-team-a-0001\n\nsk-team-b-0002 qwen3 minilm  # two\n")
    assert len(keys.by_digest) == 2
    by_models = {k.scopes for k in keys.by_digest.values()}
    assert by_models == {None, frozenset({"qwen3", "minilm"})}
    assert all(k.id.startswith("sha256:") and len(k.id) == 15 for k in keys.by_digest.values())


@pytest.mark.parametrize(("text", "why"), [("short", "at least 8"),
                                           ("sk-same-key-1\nsk-same-key-1", "listed twice")])
def test_a_bad_keys_file_says_which_line(text: str, why: str) -> None:
    with pytest.raises(KeysError, match=why):
        parse_keys(text, "keys")


def test_the_bearer_header_gives_the_key() -> None:
    assert bearer(["Bearer sk-abc"])[0] == "sk-abc" and bearer(["bearer  sk-abc "])[0] == "sk-abc"
    assert bearer([]) == (None, "no_token") and bearer(["Basic xyz"]) == (None, "not_bearer")
    assert bearer(["Bearer"]) == (None, "no_token")
    assert bearer(["Bearer a1234567", "Bearer a1234567"]) == (None, "two_headers")


def test_a_changed_keys_file_is_taken_and_a_broken_one_keeps_the_last_keys(
        tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-first-key-1\n")
    keys = KeyFile(path)
    keys.load()
    assert keys.lookup("sk-first-key-1") is not None and keys.lookup("sk-other-1") is None
    path.write_text("sk-second-key-22 only-this\n")
    os.utime(path, (1, 1))  # a different stamp, even within one clock tick
    keys.check()
    assert keys.lookup("sk-first-key-1") is None
    second = keys.lookup("sk-second-key-22")
    assert second is not None and second.may_use("only-this") and not second.may_use("other")
    path.write_text("bad\n")
    keys.check()
    assert keys.lookup("sk-second-key-22") is not None
    assert not KeyFile(None).enabled and KeyFile(None).lookup("x") is None


def test_an_unreadable_keys_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(KeysError, match="cannot be read"):
        KeyFile(tmp_path / "missing").load()


# ---- usage in answers -----------------------------------------------------------------------


def test_usage_is_found_in_a_json_answer_and_in_the_tail_of_a_stream() -> None:
    answer = json.dumps({"choices": [{"text": '"usage": {"prompt_tokens": 99}'}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 7,
                                   "total_tokens": 12}}).encode()
    assert usage_of(answer) == (5, 7)
    stream = (b'data: {"choices": [], "usage": null}\n\ndata: {"choices": [], "usage": '
              b'{"prompt_tokens": 3, "completion_tokens": 4}}\n\ndata: [DONE]\n\n')
    assert usage_of(stream) == (3, 4)
    assert usage_of(b'data: {"usage": null}\n\n') is None
    assert usage_of(b'{"usage": {"prompt_tokens": 8, "total_tokens": 8}}') == (8, 0)


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.text(max_size=50))
def test_usage_is_read_whatever_text_comes_before_it(prompt: int, done: int, text: str) -> None:
    doc = {"choices": [{"text": text}], "usage": {"prompt_tokens": prompt,
                                                  "completion_tokens": done}}
    assert usage_of(json.dumps(doc).encode()) == (prompt, done)


# ---- ledger and changes ---------------------------------------------------------------------


def test_held_requests_are_bounded_per_model_and_counts_go_back_to_zero() -> None:
    ledger = Ledger()
    ledger.enter("m")
    assert ledger.try_hold("m", 2) and ledger.try_hold("m", 2) and not ledger.try_hold("m", 2)
    assert ledger.try_hold("other", 2)
    ledger.release("m")
    assert ledger.try_hold("m", 2)
    for _ in range(2):
        ledger.release("m")
    ledger.release("other")
    ledger.leave("m")
    assert (ledger.in_flight("m"), ledger.held("m"), ledger.models()) == (0, 0, [])


async def test_a_change_wakes_every_waiter_that_looked_before_it() -> None:
    changes = Changes()
    first, second = changes.next(), changes.next()
    assert first is second
    changes.bump()
    assert first.is_set() and changes.version == 1
    later = changes.next()
    assert not later.is_set()
    waiter = asyncio.ensure_future(later.wait())
    changes.bump()
    await asyncio.wait_for(waiter, 1)
