"""HTTP calls the agent makes to one engine: health, sleep state, sleep, wake, request figures.

Every call has its own timeout and turns transport failures into plain results or one
exception type, so an owner never sees aiohttp's exception zoo. A connection refused while the
process lives means the engine is still booting, not that it failed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from guard import jsonbody

# The most an engine's answer to a control call may hold (its /metrics with many adapters is the
# largest, well under this); a hostile engine's endless body is cut here, not held in memory.
MAX_ANSWER = 16 << 20


class EngineCallError(RuntimeError):
    """An engine answered a lifecycle call with an error, or did not answer in time.

    ``status`` is the engine's HTTP status when it answered one (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RequestFigures:
    """Request counts: whole numbers (Prometheus writes them as floats, e.g. ``3.0``)."""

    running: int
    waiting: int
    success_total: int


# Sample names of the request figures, per engine kind.
VLLM_FIGURES: Mapping[str, str] = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:request_success_total": "success_total",
}


def parse_request_figures(text: str,
                          names: Mapping[str, str] = VLLM_FIGURES) -> RequestFigures | None:
    """Sum the request series in ``names`` over their labels from a Prometheus exposition.

    An engine's /metrics carries hundreds of histogram lines the agent does not need, and this
    runs every few seconds for every engine, so only the lines of the wanted series are handed
    to prometheus_client's parser (a whole vLLM page through the parser costs milliseconds).
    None when the page carries none of them (metrics off, or another engine's page).
    """
    wanted = tuple(names)
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    sums = {key: 0.0 for key in names.values()}
    seen = False
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                key = names.get(sample.name)
                if key is not None and math.isfinite(sample.value):
                    sums[key] += sample.value
                    seen = True
    except ValueError:  # a malformed line: no figures rather than wrong ones
        return None
    if not seen:
        return None
    return RequestFigures(**{k: int(round(v)) for k, v in sums.items()})


# vLLM's ``vllm:engine_sleep_state`` series: the one at 1 says the sleep level (0: awake).
_SLEEP_STATES: Mapping[str, int] = {"awake": 0, "weights_offloaded": 1, "discard_all": 2}


def parse_sleep_level(text: str) -> int | None:
    """The sleep level vLLM's /metrics says it is at (0 awake, 1, 2); None when it does not say.

    ``/is_sleeping`` only says whether; this gauge says which, so a sleep whose level no
    record holds (a record rebuilt from the process) is still known."""
    lines = [line for line in text.splitlines() if line.startswith("vllm:engine_sleep_state")]
    levels = set()
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                level = _SLEEP_STATES.get(sample.labels.get("sleep_state", ""))
                if level is not None and sample.value == 1:
                    levels.add(level)
    except ValueError:
        return None
    return levels.pop() if len(levels) == 1 else None


class EngineClient:
    def __init__(self, session: aiohttp.ClientSession, host: str, port: int) -> None:
        self._session = session
        self._base = f"http://{host}:{port}"

    async def _get(self, path: str, timeout_s: float) -> tuple[int, str] | None:
        """Status and body of a GET; None when refused, failing, too slow or over
        ``MAX_ANSWER`` (an engine is a peer: its answer is read with a bound)."""
        try:
            async with self._session.get(
                f"{self._base}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                raw = await resp.content.read(MAX_ANSWER + 1)
                if len(raw) > MAX_ANSWER:
                    return None
                return resp.status, raw.decode(resp.charset or "utf-8")
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
            body = jsonbody.loads(answer[1])
        except ValueError:
            return None
        value = body.get("is_sleeping") if isinstance(body, dict) else None
        return value if isinstance(value, bool) else None

    async def post(self, path: str, timeout_s: float, body: object | None = None) -> str:
        """POST to the engine and return its answer's text; any answer but 2xx, or none in
        time, is an EngineCallError."""
        try:
            async with self._session.post(
                f"{self._base}{path}", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                text = await resp.text()
                if resp.status >= 300:
                    raise EngineCallError(f"POST {path} answered {resp.status}: {text[:500]}",
                                          resp.status)
                return text
        except asyncio.TimeoutError as exc:
            raise EngineCallError(f"POST {path} got no answer within {timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise EngineCallError(f"POST {path} failed: {exc}") from exc


    async def served_models(self, timeout_s: float) -> list[dict[str, object]] | None:
        """The cards of ``GET /v1/models`` (base model and LoRA adapters); None without one."""
        answer = await self._get("/v1/models", timeout_s)
        if answer is None or answer[0] != 200:
            return None
        try:
            data = jsonbody.loads(answer[1]).get("data")
        except (ValueError, AttributeError):
            return None
        return [card for card in data if isinstance(card, dict)] if isinstance(data, list) else None

    async def request_figures(self, timeout_s: float,
                              names: Mapping[str, str] = VLLM_FIGURES) -> RequestFigures | None:
        return (await self.metrics_page(timeout_s, names))[0]

    async def metrics_page(self, timeout_s: float, names: Mapping[str, str] = VLLM_FIGURES
                           ) -> tuple[RequestFigures | None, int | None]:
        """One read of /metrics: the request figures and the sleep level it says."""
        answer = await self._get("/metrics", timeout_s)
        if answer is None or answer[0] != 200:
            return None, None
        return parse_request_figures(answer[1], names), parse_sleep_level(answer[1])
