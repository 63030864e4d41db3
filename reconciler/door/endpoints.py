"""The engines' routes the door passes on by model, and which engine kinds serve each.

One table, looked up once per request (a dict lookup: the chat path pays nothing for the
others). Each path names its endpoint label (the metrics' ``endpoint``, the usage and window
rules) and the engine kinds that serve it, so a request for an engine that has no such route
is answered by the door (400, saying which kinds do) instead of waking a model for a 404.

What is here and why (vLLM's route table: ``vllm/entrypoints/openai/api_server.py`` and the
routers it registers; SGLang's: ``python/sglang/srt/entrypoints/http_server.py``): every POST
route of theirs that a client uses and that names its ``model`` in the JSON body. What is left
out, and why, is in ``docs/door.md`` ("Routes"). Ollama's native ``/api/chat`` and
``/api/generate`` go to Ollama claims only (``reconciler.door.ollama`` answers ``/api/tags`` and
``/api/ps`` from the door's own view).
"""

from __future__ import annotations

VLLM, SGLANG, OLLAMA = "vllm", "sglang", "ollama"
ALL = frozenset((VLLM, SGLANG, OLLAMA))
OPENAI_ENGINES = frozenset((VLLM, SGLANG))

ENDPOINTS: dict[str, tuple[str, frozenset[str]]] = {
    "/v1/chat/completions": ("chat", ALL),
    "/v1/completions": ("completion", ALL),
    "/v1/embeddings": ("embedding", ALL),
    "/v1/responses": ("responses", OPENAI_ENGINES),
    "/rerank": ("rerank", frozenset((VLLM,))),
    "/v1/rerank": ("rerank", OPENAI_ENGINES),
    "/v2/rerank": ("rerank", frozenset((VLLM,))),
    "/score": ("score", frozenset((VLLM,))),
    "/v1/score": ("score", OPENAI_ENGINES),
    "/pooling": ("pooling", frozenset((VLLM,))),
    "/classify": ("classify", frozenset((VLLM,))),
    "/v1/classify": ("classify", frozenset((SGLANG,))),
    "/tokenize": ("tokenize", OPENAI_ENGINES),
    "/detokenize": ("detokenize", OPENAI_ENGINES),
    "/v1/tokenize": ("tokenize", frozenset((SGLANG,))),
    "/v1/detokenize": ("detokenize", frozenset((SGLANG,))),
    "/api/chat": ("ollama_chat", frozenset((OLLAMA,))),
    "/api/generate": ("ollama_generate", frozenset((OLLAMA,))),
}

OLLAMA_NATIVE = frozenset(("ollama_chat", "ollama_generate"))


def engines_for(path: str) -> frozenset[str]:
    return ENDPOINTS[path][1]


def kinds_text(kinds: frozenset[str]) -> str:
    names = {VLLM: "vLLM", SGLANG: "SGLang", OLLAMA: "Ollama"}
    return " and ".join(names[k] for k in sorted(kinds))
