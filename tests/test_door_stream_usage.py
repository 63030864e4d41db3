"""Streamed requests count their tokens (issue 22): the door asks the engine for usage when the
client did not, so ``aibrix:door_tokens_total`` and the access log carry the engine's own
counts, and the client still gets exactly the events it asked for.

End to end: the real ``openai`` client streams chat and completions through the door to a real
agent's simulated vLLM and Ollama engines, with and without ``include_usage``, and the same
requests straight to the engine's port are the reference. The filter alone
(``reconciler.door.usage.Hider``) is checked on every way of cutting a stream into pieces."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import Omit, omit
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam

from reconciler.door.usage import Hider, upstream_body
from tests.test_door_integration import CHAT, Door, claim, door, metric

pytestmark = [pytest.mark.timeout(180)]
__all__ = ["door"]  # the fixture, used by name
TOKENS = 5
VARYING = {"id", "created"}  # differ from one answer to the next, by design
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": CHAT[0]["content"]}]


async def streamed(base_url: str, endpoint: str, model: str,
                   include_usage: bool) -> list[dict[str, Any]]:
    """The chunks the ``openai`` client yields, as the fields the answer set (less ids)."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                timeout=30)
    options: ChatCompletionStreamOptionsParam | Omit = {"include_usage": True} \
        if include_usage else omit
    try:
        if endpoint == "chat":
            chat = await client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=TOKENS, stream=True,
                stream_options=options)
            return [c.model_dump(exclude_unset=True, exclude=VARYING) async for c in chat]
        done = await client.completions.create(model=model, prompt="Count to five.",
                                               max_tokens=TOKENS, stream=True,
                                               stream_options=options)
        return [c.model_dump(exclude_unset=True, exclude=VARYING) async for c in done]
    finally:
        await client.close()


async def tokens(door: Door, model: str) -> tuple[float, float]:
    text = await door.metrics()
    return (metric(text, "aibrix:door_tokens_total", model=model, kind="prompt") or 0.0,
            metric(text, "aibrix:door_tokens_total", model=model, kind="completion") or 0.0)


async def check_every_stream(door: Door, model: str, engine_model: str | None = None) -> None:
    """Each endpoint, with and without ``include_usage``: the client's chunks are the engine's
    own answer to the client's request, and the door counted the engine's usage. The engine
    is asked for ``engine_model`` (an Ollama server knows its model by its tag)."""
    engine = f"http://127.0.0.1:{door.engine(model)['port']}"
    engine_model = engine_model or model
    lines = len(door.access())
    for endpoint in ("chat", "completion"):
        asked = await streamed(engine, endpoint, engine_model, True)
        usage = asked[-1]["usage"]
        assert asked[-1]["choices"] == [] and usage["completion_tokens"] > 0, asked[-1]
        for include_usage in (False, True):
            before = await tokens(door, model)
            got = await streamed(door.url, endpoint, model, include_usage)
            want = asked if include_usage else \
                await streamed(engine, endpoint, engine_model, False)
            assert got == want, (endpoint, include_usage)
            assert not include_usage or got[-1]["usage"] == usage
            after = await tokens(door, model)
            assert (after[0] - before[0], after[1] - before[1]) == (
                usage["prompt_tokens"], usage["completion_tokens"]), (endpoint, include_usage)
            lines += 1
            line = await door.logged(lines)
            assert line["stream"] is True and line["status"] == 200
            assert (line["prompt_tokens"], line["completion_tokens"]) == (
                usage["prompt_tokens"], usage["completion_tokens"]), line


@pytest.mark.integration
async def test_streams_to_a_vllm_engine_count_their_tokens_and_show_only_what_was_asked(
        door: Door) -> None:
    door.pool()
    await door.start()
    door.write("m", claim("m"))
    await door.phase("m", "Active")
    await check_every_stream(door, "m")


@pytest.mark.integration
async def test_streams_to_an_ollama_engine_count_their_tokens_and_show_only_what_was_asked(
        door: Door) -> None:
    door.pool()
    await door.start()
    door.write("q", claim("q", engine="ollama", artifact="ollama://qwen3:0.6b",
                          model="qwen3-0-6b", **{"--context-length": "4096"}))
    await door.phase("q", "Active")
    await check_every_stream(door, "qwen3-0-6b", "qwen3:0.6b")


# ---- the filter alone ---------------------------------------------------------------------------

CONTENT = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
           b'{"content":"usage"}}],"usage":null}\n\n')
SPACED = b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
OLLAMA_CHUNK = (b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"text":"a",'
                b'"index":0,"finish_reason":null}],"model":"q","system_fingerprint":"fp_ollama"')
ZERO = b',"usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}'
USAGE_EVENT = (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,'
               b'"total_tokens":8,"prompt_tokens_details":{"cached_tokens":0}}}\n\n')
SPACED_USAGE = b'data: {"id": "c", "choices": [ ], "usage": {"prompt_tokens": 3}}\n\n'
DONE = b"data: [DONE]\n\n"
SHAPES = [  # (what the engine sends, what the client that did not ask gets)
    (CONTENT * 3 + USAGE_EVENT + DONE, CONTENT * 3 + DONE),  # vLLM, SGLang ("usage":null)
    (SPACED * 2 + SPACED_USAGE + DONE, SPACED * 2 + DONE),  # the simulator's json.dumps
    ((OLLAMA_CHUNK + ZERO + b"}\n\n") * 3 + USAGE_EVENT + DONE,
     (OLLAMA_CHUNK + b"}\n\n") * 3 + DONE),  # Ollama's /v1/completions
]


@settings(max_examples=300, deadline=None)
@given(shape=st.sampled_from(SHAPES), cuts=st.lists(st.integers(0, 2000), max_size=12))
def test_the_usage_nobody_asked_for_leaves_a_stream_however_it_is_cut(
        shape: tuple[bytes, bytes], cuts: list[int]) -> None:
    sent, wanted = shape
    points = sorted({c % (len(sent) + 1) for c in cuts})
    pieces = [sent[a:b] for a, b in zip([0, *points], [*points, len(sent)], strict=True)]
    hider = Hider()
    got = b"".join(hider.piece(p) for p in pieces[:-1]) + hider.last(pieces[-1])
    assert got == wanted


def test_a_stream_without_event_ends_passes_untouched_past_the_hold_limit() -> None:
    hider = Hider()
    blob = b"x" * ((1 << 20) + 1)
    assert hider.piece(blob) == blob and hider.piece(USAGE_EVENT) == USAGE_EVENT


def test_only_streams_that_did_not_ask_for_usage_are_asked_for_it() -> None:
    doc: dict[str, Any] = {"model": "m", "stream": True}
    assert upstream_body("chat", doc, b'{"model": "m", "stream": true} ', "m") == (
        b'{"model": "m", "stream": true,"stream_options":{"include_usage":true}}', True)
    asked = {**doc, "stream_options": {"include_usage": True}}
    assert upstream_body("completion", asked, b"{}", "m") == (b"{}", False)
    no = {**doc, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    body, hide = upstream_body("chat", no, b"{}", "tag")
    assert hide and body == (b'{"model": "tag", "stream": true, "stream_options": '
                             b'{"include_usage": true}}')
    assert upstream_body("embedding", doc, b"{}", "m") == (b"{}", False)
    assert upstream_body("chat", {"model": "m"}, b"{}", "m") == (b"{}", False)
    odd = {**doc, "stream_options": "yes"}  # the engine's to refuse, as the client sent it
    assert upstream_body("chat", odd, b"{}", "m") == (b"{}", False)
