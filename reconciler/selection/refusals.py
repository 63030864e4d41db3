"""Why a call to a route cannot be served, as values the door answers with (the seed's
"Waiting for GPU capacity" and "Zero-Match Surface", issue 24 item 5).

| refusal | answer | when |
|---|---|---|
| ``ZeroMatch`` | 503, no Retry-After, ``no_matching_model`` | the route's require admits no claim; it names the selector |
| ``ModelTooLarge`` | 503, no Retry-After, ``model_too_large`` | no candidate fits any GPU that published its memory |
| ``PromptTooLarge`` | 400, ``context_length_exceeded`` | no candidate that fits in memory has a context that holds the call |
| ``Busy`` | 503 with Retry-After, ``gpu_busy`` | some GPU could hold it, none can now: the caller holds the call, then answers this |

The prompt check is the engine's own (``context_needed``), so the door's answer is the only
shape a client sees and no model is woken or started just to refuse: vLLM refuses a prompt or
a ``max_tokens`` (``max_completion_tokens``) over the context, SGLang a prompt plus
``max_tokens`` over it; Ollama truncates instead of refusing, so only its prompt is counted, as
the seed says. An unknown context never refuses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from contract.quantity import gib

BUSY_RETRY_AFTER = 20  # the door's Retry-After while room is made (door.plan.RETRY_AFTER)


@dataclass(frozen=True)
class PromptNeed:
    """The call's prompt in tokens (counted or estimated), its ``max_tokens`` (None: not
    given) and the request field it came in (``messages``, ``prompt``, ``input``)."""

    tokens: int
    max_tokens: int | None = None
    param: str = "messages"


def context_needed(prompt: PromptNeed, engine: str) -> int:
    """Tokens of context the engine needs for the call, as the engine counts them: vLLM (0.32)
    refuses a prompt over the context and a ``max_tokens`` over it, and shortens a
    ``max_tokens`` that only leaves too little room after the prompt; SGLang refuses a prompt
    plus ``max_tokens`` over the context (and a prompt that fills it); Ollama truncates."""
    if engine == "ollama":
        return prompt.tokens
    if engine == "vllm":
        return max(prompt.tokens, prompt.max_tokens or 0)
    if prompt.max_tokens is None or prompt.max_tokens <= 0:
        return prompt.tokens + 1  # the engine refuses a prompt that fills the whole context
    return prompt.tokens + prompt.max_tokens


MOST = "sglang"  # the engine whose count is the largest: a call it holds, every engine holds


def holds(context: int | None, prompt: PromptNeed | None, engine: str) -> bool:
    return context is None or prompt is None or context_needed(prompt, engine) <= context


@dataclass(frozen=True)
class ZeroMatch:
    route: str
    selector: str
    status: int = 503
    code: str = "no_matching_model"
    retry_after: int | None = None

    @property
    def message(self) -> str:
        return (f"route {self.route!r} has no model: no claim matches its require selector "
                f"{{{self.selector}}}; add a claim with those labels or widen spec.require")


@dataclass(frozen=True)
class ModelTooLarge:
    route: str
    model: str
    footprint: int
    largest_card: int
    status: int = 503
    code: str = "model_too_large"
    retry_after: int | None = None

    @property
    def message(self) -> str:
        return (f"route {self.route!r}: no GPU can hold {self.model!r} ({gib(self.footprint)} "
                f"per GPU; the largest card has {gib(self.largest_card)} usable): add a "
                f"smaller model to the route or a larger GPU")


@dataclass(frozen=True)
class PromptTooLarge:
    route: str
    prompt: PromptNeed
    context: int
    status: int = 400
    code: str = "context_length_exceeded"
    retry_after: int | None = None

    @property
    def message(self) -> str:
        p, what = self.prompt, self.prompt.param
        if p.max_tokens and p.max_tokens > self.context and p.tokens <= self.context:
            return (f"This model's maximum context length is {self.context} tokens. However, "
                    f"you requested {p.max_tokens} tokens for the completion alone. Please "
                    "reduce the number of tokens requested for the completion.")
        if p.max_tokens and p.tokens < self.context:
            return (f"This model's maximum context length is {self.context} tokens. However, "
                    f"you requested {p.tokens + p.max_tokens} tokens ({p.tokens} in the {what}, "
                    f"{p.max_tokens} in the completion). Please reduce the length of the "
                    f"{what} or completion.")
        return (f"This model's maximum context length is {self.context} tokens. However, your "
                f"{what} resulted in {p.tokens} tokens. Please reduce the length of the {what}.")


@dataclass(frozen=True)
class Busy:
    """Nothing can serve now but something could later: hold the call (woken by the next
    change), and answer this when the hold runs out."""

    route: str
    model: str
    expected_s: float | None = None  # the best option's expected wait, when one was seen
    status: int = 503
    code: str = "gpu_busy"

    @property
    def retry_after(self) -> int:
        if self.expected_s is None:
            return BUSY_RETRY_AFTER
        return max(1, math.ceil(self.expected_s))

    @property
    def message(self) -> str:
        return (f"route {self.route!r}: every GPU that can hold {self.model!r} is busy; "
                f"try again later")


Refusal = ZeroMatch | ModelTooLarge | PromptTooLarge | Busy
