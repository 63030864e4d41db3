"""The one HTTP path to engines, shared by the agent and the door: it imports neither
(``.importlinter``: it sits on httptools and ``guard`` alone), so both sides may import it.

- ``engine_http.framing``: llhttp's framing of an engine's answer, strict (``ResponseParser``);
- ``engine_http.upstream``: ``Upstream``, pooled HTTP/1.1 connections (the door's proxy path);
- ``engine_http.calls``: a whole call within one deadline and a size bound (the agent's
  ``engines.client`` and the door's own asks).
"""
