"""HTTP calls the agent makes to one engine: health, sleep state, sleep, wake, request figures.

Every call has its own timeout and turns transport failures into plain results or one
exception type, so an owner never sees a transport's exception zoo. A connection refused while
the process lives means the engine is still booting, not that it failed. The calls go over the
one HTTP path to engines (``engine_http``: pooled connections, llhttp framing, a deadline and a
size bound on every call), so a hostile engine's answer (a negative length, an endless body, a
stall) is a plain failure within the call's timeout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from msgspec import Struct
from prometheus_client.parser import text_string_to_metric_families

from engine_http.calls import MAX_ANSWER, call, get_json, post_json
from engine_http.framing import UpstreamError, UpstreamTimeout
from engine_http.upstream import Upstream

# MAX_ANSWER: the most an engine's answer to a control call may hold (its /metrics with many
# adapters is the largest, well under it); a hostile engine's endless body is cut there.


class EngineCallError(RuntimeError):
    """An engine answered a lifecycle call with an error, or did not answer in time.

    ``status`` is the engine's HTTP status when it answered one (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RequestFigures(Struct, frozen=True):
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
    def __init__(self, http: Upstream, host: str, port: int) -> None:
        self._http = http
        self._host = host
        self._port = port

    async def _get(self, path: str, timeout_s: float) -> tuple[int, str] | None:
        """Status and body of a GET; None when refused, failing, too slow or over
        ``MAX_ANSWER`` (an engine is a peer: its answer is read with a bound)."""
        try:
            reply = await call(self._http, "GET", self._host, self._port, path, timeout_s)
            return reply.status, reply.body.decode()
        except (UpstreamError, UnicodeDecodeError):
            return None

    async def health(self, timeout_s: float, path: str = "/health") -> bool:
        """True when ``path`` answers 200; False when refused, failing or too slow."""
        answer = await self._get(path, timeout_s)
        return answer is not None and answer[0] == 200

    async def is_sleeping(self, timeout_s: float) -> bool | None:
        """The engine's own word on sleep; None when it has no sleep endpoint or did not say."""
        body = await get_json(self._http, self._host, self._port, "/is_sleeping", timeout_s)
        value = body.get("is_sleeping") if isinstance(body, dict) else None
        return value if isinstance(value, bool) else None

    async def post(self, path: str, timeout_s: float, body: object | None = None) -> str:
        """POST to the engine (on a new connection: never sent twice) and return its answer's
        text; any answer but 2xx, or none in time, is an EngineCallError."""
        try:
            reply = await post_json(self._http, self._host, self._port, path, body, timeout_s)
        except UpstreamTimeout as exc:
            raise EngineCallError(f"POST {path} got no answer within {timeout_s:g} s") from exc
        except UpstreamError as exc:
            raise EngineCallError(f"POST {path} failed: {exc}") from exc
        text = reply.body.decode(errors="replace")
        if reply.status >= 300:
            raise EngineCallError(f"POST {path} answered {reply.status}: {text[:500]}",
                                  reply.status)
        return text

    async def served_models(self, timeout_s: float) -> list[dict[str, object]] | None:
        """The cards of ``GET /v1/models`` (base model and LoRA adapters); None without one."""
        doc = await get_json(self._http, self._host, self._port, "/v1/models", timeout_s)
        data = doc.get("data") if isinstance(doc, dict) else None
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
