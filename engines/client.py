"""HTTP calls the agent makes to one engine: health, sleep state, sleep, wake, request figures.

Every call has its own timeout and turns transport failures into plain results or one
exception type, so an owner never sees aiohttp's exception zoo. A connection refused while the
process lives means the engine is still booting, not that it failed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp


class EngineCallError(RuntimeError):
    """An engine answered a lifecycle call with an error, or did not answer in time."""


@dataclass(frozen=True)
class RequestFigures:
    running: float
    waiting: float
    success_total: float


_FIGURES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:request_success_total": "success_total",
}


def parse_request_figures(text: str) -> RequestFigures:
    """Sum vLLM's three request series over their labels from a Prometheus text exposition.

    A line scan, not a full parser: vLLM's /metrics carries hundreds of histogram lines the agent
    does not need, and this runs every few seconds for every engine.
    """
    sums = {"running": 0.0, "waiting": 0.0, "success_total": 0.0}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = len(line)
        for sep in ("{", " "):
            idx = line.find(sep)
            if 0 <= idx < name_end:
                name_end = idx
        key = _FIGURES.get(line[:name_end])
        if key is None:
            continue
        value_part = line.rsplit("}", 1)[-1] if "}" in line else line[name_end:]
        fields = value_part.split()
        if not fields:
            continue
        try:
            sums[key] += float(fields[0])
        except ValueError:
            continue
    return RequestFigures(**sums)


class EngineClient:
    def __init__(self, session: aiohttp.ClientSession, host: str, port: int) -> None:
        self._session = session
        self._base = f"http://{host}:{port}"

    async def _get(self, path: str, timeout_s: float) -> tuple[int, str] | None:
        """Status and body of a GET; None when refused, failing or too slow."""
        try:
            async with self._session.get(
                f"{self._base}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError):
            return None

    async def health(self, timeout_s: float, path: str = "/health") -> bool:
        """True when ``path`` answers 200; False when refused, failing or too slow."""
        answer = await self._get(path, timeout_s)
        return answer is not None and answer[0] == 200

    async def is_sleeping(self, timeout_s: float) -> bool | None:
        """The engine's own word on sleep; None when it has no sleep endpoint or did not say."""
        answer = await self._get("/is_sleeping", timeout_s)
        if answer is None or answer[0] != 200:
            return None
        try:
            body = json.loads(answer[1])
        except ValueError:
            return None
        value = body.get("is_sleeping") if isinstance(body, dict) else None
        return value if isinstance(value, bool) else None

    async def post(self, path: str, timeout_s: float, body: object | None = None) -> None:
        """POST to the engine; any answer but 2xx, or none in time, is an EngineCallError."""
        try:
            async with self._session.post(
                f"{self._base}{path}", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status >= 300:
                    text = (await resp.text())[:500]
                    raise EngineCallError(f"POST {path} answered {resp.status}: {text}")
        except asyncio.TimeoutError as exc:
            raise EngineCallError(f"POST {path} got no answer within {timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise EngineCallError(f"POST {path} failed: {exc}") from exc


    async def request_figures(self, timeout_s: float) -> RequestFigures | None:
        answer = await self._get("/metrics", timeout_s)
        if answer is None or answer[0] != 200:
            return None
        return parse_request_figures(answer[1])
