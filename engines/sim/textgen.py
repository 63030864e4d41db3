"""Deterministic "model output" for the simulated engine.

Tests and demos need completions that are reproducible (the same prompt always yields the same text)
yet differ between prompts, and token counts that behave like a tokenizer's. A SHA-256 of the prompt
seeds a private random generator that picks words from a fixed vocabulary; one word is one token.
Token ids (``/tokenize``) and embedding vectors (``/v1/embeddings``) are derived the same way.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence

_VOCABULARY: tuple[str, ...] = (
    "the", "warm", "pool", "engine", "wakes", "sleeps", "token", "cache", "model", "claim",
    "memory", "card", "fast", "quiet", "river", "stone", "light", "signal", "north", "garden",
    "paper", "orbit", "copper", "violet", "lantern", "harbor", "meadow", "cloud", "ember", "falcon",
    "glacier", "horizon", "island", "jasmine", "kernel", "ladder", "marble", "needle", "ocean",
    "pepper", "quartz", "ribbon", "saddle", "thunder", "umbrella", "velvet", "willow", "yonder",
    "zephyr", "and", "of", "to", "in", "a", "is", "on", "with", "under", "over", "beyond",
)


def generate_tokens(prompt: str, count: int) -> list[str]:
    """``count`` tokens derived from ``prompt``; each token after the first carries a leading space."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big")
    rng = random.Random(seed)
    words = [rng.choice(_VOCABULARY) for _ in range(count)]
    return [word if index == 0 else " " + word for index, word in enumerate(words)]


ANSWER_TOKENS = (24, 200)  # the range of a natural answer's length, end-of-sequence excluded


def answer_length(prompt: str) -> int:
    """How many tokens the "model" says to ``prompt`` before its end-of-sequence token: a real
    model stops on its own, and vLLM then reports ``finish_reason`` "stop"; cut short by
    ``max_tokens``, it reports "length". Derived from the prompt, so reproducible."""
    seed = int.from_bytes(hashlib.sha256(("length:" + prompt).encode("utf-8")).digest()[:8], "big")
    low, high = ANSWER_TOKENS
    return low + seed % (high - low)


def finish_reason(prompt: str, max_tokens: int) -> tuple[int, str]:
    """(tokens generated, vLLM's ``finish_reason``) for ``prompt`` under ``max_tokens``."""
    natural = answer_length(prompt)
    return (max_tokens, "length") if max_tokens <= natural else (natural, "stop")


def count_tokens(text: str) -> int:
    """A tokenizer stand-in: whitespace-separated words, at least one for any prompt."""
    return max(1, len(text.split()))


def chat_prompt(messages: Sequence[object]) -> str:
    """Flatten OpenAI chat messages (string or content-part lists) into one prompt string."""
    lines: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError("each message needs a string 'role'")
        content = message.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = [part.get("text", "") for part in content if isinstance(part, dict)]
            content = " ".join(str(part) for part in parts)
        if not isinstance(content, str):
            raise ValueError("message 'content' must be a string or a list of parts")
        lines.append(f"{role}: {content}")
    return "\n".join(lines)


def token_ids(text: str) -> list[int]:
    """The ids the stand-in tokenizer gives ``text``: one per word (as ``count_tokens`` counts them),
    each word's vocabulary index, or a stable hash into a 32k vocabulary for any other word."""
    words = text.split() or [""]
    return [_INDEX.get(word, 1000 + int.from_bytes(hashlib.sha256(word.encode("utf-8")).digest()[:4], "big")
                       % 31000) for word in words]


def embedding(text: str, dim: int) -> list[float]:
    """A deterministic unit vector for ``text``: the same text always embeds to the same vector."""
    seed = int.from_bytes(hashlib.sha256(("embed:" + text).encode("utf-8")).digest()[:8], "big")
    rng = random.Random(seed)
    values = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


_INDEX = {word.strip(): index for index, word in enumerate(_VOCABULARY)}


def word_of(token: int) -> str:
    """The word behind a vocabulary id (``/detokenize``); ``<id>`` for a hashed one."""
    return _VOCABULARY[token].strip() if 0 <= token < len(_VOCABULARY) else f"<{token}>"
