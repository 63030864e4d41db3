"""The front door: one OpenAI-compatible endpoint for the whole pool.

``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` and ``/v1/models`` on one port,
routed by the request's ``model`` to the engine the reconciler's route names; a request for a
sleeping model asks for a wake and waits for it, one for a model without room waits while room
is made, within bounds. See ``docs/door.md`` for the invariants.

| module | what |
|---|---|
| ``plan`` | forward, hold or refuse, and which claim (pure) |
| ``window`` | the context-window check (pure, plus the count) |
| ``ledger`` | requests in flight and held per model; the change signal |
| ``catalog`` | names to claims, engine names, context lengths |
| ``keys``, ``errors`` | API keys; OpenAI-shaped errors |
| ``door``, ``proxy`` | one request: admit, check, forward |
| ``server``, ``service``, ``metrics``, ``access`` | HTTP, running it, what it reports |
"""
