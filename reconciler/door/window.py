"""The context window: refuse a prompt the target engine cannot hold, before it reaches it.

An engine that gets a prompt longer than its context either refuses it (vLLM: 400) or, worse,
drops the oldest text and answers without it (Ollama truncates silently). The door refuses such
a prompt itself, with OpenAI's ``context_length_exceeded`` error, counting it with the engine's
own tokenizer where the engine has one (vLLM's ``POST /tokenize``, which answers while the engine
sleeps too), and otherwise estimating 3.5 characters per token (the ratio Kubemoot starts from:
prose runs near 4, JSON and code nearer 3). An unknown context never refuses a call, and neither
does a count the engine could not give.

Counting costs a round trip, so it is skipped when it cannot matter: a token is at least one
byte of its text (byte-level BPE and SentencePiece with byte fallback alike), and a chat
template's few tokens per message are fewer than the JSON around each message, so a request
body of at most ``context`` bytes holds at most ``context`` prompt tokens. Only larger bodies are
counted; typical chat requests never are.

The prompt is checked (Kubemoot's rule), and ``max_tokens`` as vLLM counts it: vLLM refuses a
``max_tokens`` (``max_completion_tokens`` for a chat) larger than the whole context, and shortens
one that only leaves too little room after the prompt (``get_max_tokens``), so the door refuses
the first itself, in the same shape, and forwards the second. Ollama caps its output at the
context silently, so only the prompt is checked there.

Both checks run before the request may wake or start its model (``Door.check_early``): the
refusal needs only the context and a count, and a sleeping vLLM engine still counts. A request
whose count needs an engine that is not running yet is checked once it runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contract.numbers import whole_number

CHARS_PER_TOKEN = 3.5


@dataclass(frozen=True)
class Prompt:
    """What to count: the request's field (``messages``, ``prompt`` or ``input``) and how."""

    param: str
    tokenize_body: dict[str, Any] | None  # what to send to /tokenize (None: nothing to count)
    text: str  # for an estimate
    token_ids: int | None = None  # a prompt given as token ids: its length is its count


COUNTED = frozenset(("chat", "completion", "embedding"))  # endpoints whose prompt is checked


def needs_count(body_bytes: int, context: int | None) -> bool:
    """Whether a body of ``body_bytes`` could hold more than ``context`` prompt tokens."""
    return context is not None and body_bytes > context


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def prompt_of(endpoint: str, doc: Mapping[str, Any], upstream_model: str) -> Prompt | None:
    """The prompt of a chat, completion or embedding request; None when it has none to count."""
    if endpoint == "chat":
        messages = doc.get("messages")
        if not isinstance(messages, list):
            return None
        body: dict[str, Any] = {"model": upstream_model, "messages": messages,
                                "add_generation_prompt": True}
        for extra in ("tools", "chat_template_kwargs", "add_generation_prompt",
                      "continue_final_message"):
            if extra in doc:
                body[extra] = doc[extra]
        return Prompt("messages", body, json.dumps(messages, ensure_ascii=False))
    field = "prompt" if endpoint == "completion" else "input"
    value = doc.get(field)
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return Prompt(field, None, "", token_ids=len(value))
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return Prompt(field, None, "", token_ids=max(len(v) for v in value))
    texts = _texts(value)
    if not texts:
        return None
    longest = max(texts, key=len)  # each prompt of a batch must fit on its own
    return Prompt(field, {"model": upstream_model, "prompt": longest}, longest)


OUTPUT_LIMITS = {"chat": ("max_completion_tokens", "max_tokens"), "completion": ("max_tokens",)}


def output_limit(endpoint: str, doc: Mapping[str, Any]) -> tuple[str, int] | None:
    """The field and value of the output tokens a chat or completion request asks for, the way
    vLLM reads it (a chat's ``max_completion_tokens`` before its ``max_tokens``); None when it
    asks for none, or for something the engine refuses anyway (not a whole number)."""
    for field in OUTPUT_LIMITS.get(endpoint, ()):
        value = doc.get(field)
        if value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return field, value
        return None
    return None


def output_refusal(context: int, asked: int) -> str:
    """OpenAI's wording for an answer that could never fit the context."""
    return (f"This model's maximum context length is {context} tokens. However, you requested "
            f"{asked} tokens for the completion alone. Please reduce the number of tokens "
            "requested for the completion.")


def estimate(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def exceeded(count: int | None, context: int | None) -> bool:
    return count is not None and context is not None and count > context


def refusal_message(count: int, context: int, param: str) -> str:
    """OpenAI's wording for a prompt over the context window."""
    what = {"messages": "messages", "prompt": "prompt", "input": "input"}[param]
    return (f"This model's maximum context length is {context} tokens. However, your {what} "
            f"resulted in {count} tokens. Please reduce the length of the {what}.")


def context_from_args(engine: str, args: Mapping[str, str]) -> int | None:
    """The per-request context a claim's engine arguments declare (None: the engine's own
    default, learned from the engine later)."""
    names = ("--context-length",) if engine == "ollama" else (
        "--max-model-len", "--max_model_len", "--context-length")
    for name in names:
        value = args.get(name)
        if value is not None and (tokens := whole_number(value, strip=True) or 0) > 0:
            return tokens
    return None
