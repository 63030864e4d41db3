"""The reader of the agent's Server-Sent Events stream (``agent_client.sse``), fed through
aiohttp's own ``StreamReader`` in chunks cut anywhere, as a socket would deliver them."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.base_protocol import BaseProtocol
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_client.sse import ServerEvent, SSEError, read_events

pytestmark = pytest.mark.timeout(120)


def events_of(body: bytes, cuts: list[int] | None = None, **bounds: int) -> list[ServerEvent]:
    """Every event of ``body`` delivered in chunks cut at ``cuts``."""
    async def main() -> list[ServerEvent]:
        loop = asyncio.get_running_loop()
        content = aiohttp.StreamReader(BaseProtocol(loop), 1 << 16, loop=loop)
        edges = sorted({0, len(body), *(c % (len(body) + 1) for c in cuts or [])})
        for start, end in zip(edges, edges[1:], strict=False):
            content.feed_data(body[start:end])
        content.feed_eof()
        return [event async for event in read_events(content, **bounds)]

    return asyncio.run(main())


def test_named_events_multiline_data_and_ids_come_out_as_sent() -> None:
    body = (b": a comment\n"
            b"id: 7:1\nevent: reset\ndata: {\"a\": 1}\n\n"
            b"data: one\ndata: two\n\n"
            b"id: 7:2\ndata:no space\n\n")
    assert events_of(body) == [ServerEvent("reset", '{"a": 1}', "7:1"),
                               ServerEvent("message", "one\ntwo", "7:1"),
                               ServerEvent("message", "no space", "7:2")]


def test_crlf_and_lone_cr_end_lines_too() -> None:
    assert events_of(b"data: a\r\n\r\ndata: b\rdata: c\r\r\n") == [
        ServerEvent("message", "a", None), ServerEvent("message", "b\nc", None)]


def test_an_event_without_data_is_not_dispatched_and_its_name_does_not_leak() -> None:
    assert events_of(b"event: reset\n\ndata: x\n\n") == [ServerEvent("message", "x", None)]


def test_an_id_with_a_nul_is_ignored_and_a_bom_is_dropped() -> None:
    assert events_of(b"\xef\xbb\xbfid: 1\ndata: a\n\nid: 2\x00\ndata: b\n\n") == [
        ServerEvent("message", "a", "1"), ServerEvent("message", "b", "1")]


def test_a_stream_cut_inside_an_event_does_not_deliver_it() -> None:
    assert events_of(b"data: whole\n\ndata: half") == [ServerEvent("message", "whole", None)]


def test_a_line_over_the_bound_is_an_error_not_unbounded_memory() -> None:
    with pytest.raises(SSEError, match="line"):
        events_of(b"data: " + b"x" * 5000 + b"\n\n", max_line_bytes=4096)


def test_an_event_that_never_ends_is_an_error_at_its_bound() -> None:
    with pytest.raises(SSEError, match="event"):
        events_of(b"data: 0123456789\n" * 1000, max_event_chars=4096)


# -- properties ---------------------------------------------------------------------------------

FIELD_TEXT = st.text(st.characters(blacklist_characters="\r\n\0", blacklist_categories=("Cs",)),
                     max_size=20)
NAME = FIELD_TEXT.filter(lambda t: t != "")
EVENTS = st.lists(st.tuples(NAME, st.lists(FIELD_TEXT, min_size=1, max_size=3),
                            FIELD_TEXT), max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(EVENTS, st.sampled_from(["\n", "\r\n", "\r"]), st.lists(st.integers(0, 10_000)))
def test_what_a_server_writes_is_what_the_reader_returns_however_it_is_cut(
        sent: list[tuple[str, list[str], str]], end: str, cuts: list[int]) -> None:
    text = "".join(f"event: {name}{end}" + "".join(f"data: {d}{end}" for d in data)
                   + f"id: {eid}{end}{end}" for name, data, eid in sent)
    assert events_of(text.encode(), cuts) == [
        ServerEvent(name, "\n".join(data), eid) for name, data, eid in sent]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=3000), st.lists(st.integers(0, 10_000), max_size=8))
def test_any_bytes_give_well_formed_events_or_a_bound_error_and_nothing_else(
        body: bytes, cuts: list[int]) -> None:
    try:
        events = events_of(body, cuts, max_line_bytes=512, max_event_chars=1024)
    except SSEError:
        return
    for event in events:
        assert event.event and "\n" not in event.event and "\r" not in event.event
        assert "\r" not in event.data and len(event.data) <= 1024
        assert event.id is None or ("\0" not in event.id and "\n" not in event.id)
