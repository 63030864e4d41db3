"""The whole application of one simulated ``ollama serve``: the native API and the OpenAI routes.

Both route modules share the native one's helpers, so the application is put together here,
above both, and neither imports the other back.
"""

from __future__ import annotations

from aiohttp import web

from engines.sim import ollama_api, ollama_openai
from engines.sim.ollama_api import OLLAMA_STATE_KEY
from engines.sim.ollama_state import OllamaState


def build_ollama_app(state: OllamaState) -> web.Application:
    """The complete application of one simulated ``ollama serve``."""
    app = web.Application(middlewares=[ollama_api.gin_middleware])
    app[OLLAMA_STATE_KEY] = state
    ollama_api.add_routes(app)
    ollama_openai.add_routes(app)
    return app
