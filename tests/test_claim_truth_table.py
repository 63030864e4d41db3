"""The claims and ModelRoutes truth tables as a test: every cell of docs/fields.md "Claims by
situation" and "ModelRoutes by situation", on real processes.

One agent (a separate process, simulated GPU and engines) and the reconciler with its door in
this process, over a claims directory and a state directory; clients over real sockets. The
walk brings each claim (or route) into its column, then polls what the reconciler answers (the
claim's JSON, ``observed-footprints.json``, ``/v1/modelroutes``, ``/metrics``) and what is true
then (the agent's engine, what it reported to the simulated GPU and its kvcached segment, which
engine served the column's call), and checks every cell: first it has to come true, then hold
at every poll of a window, as ``tests/test_truth_table.py`` does for an engine's fields.
With ``TRUTH_REPORT=1`` the walk prints every column's failing cells instead of stopping at the
first (for editing the tables; the test then checks nothing).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from contract.footprint.reading import estimate_directory
from reconciler.local.app import ReconcilerApp, Settings
from reconciler.door.settings import DoorSettings
from reconciler.footprints import FILE_NAME
from tests.claim_truth_table import (
    CLAIM_COLUMNS,
    CLAIM_SECTION,
    ROUTE_COLUMNS,
    ROUTE_SECTION,
    Asked,
    ClaimMoment,
    RouteMoment,
    claim_check,
    route_check,
)
from tests.harness import AgentProcess
from tests.test_claim_lifecycle import annotated
from tests.test_door_integration import CHAT, SIM, Door, claim
from tests.test_door_modelroute import labelled, route
from tests.test_footprint import QWEN3_06B, model_dir
from tests.test_footprint_claims import without_per_gpu
from tests.truth_table import Truth, load_table

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

DOC = Path(__file__).resolve().parent.parent / "docs" / "fields.md"
GiB = 1 << 30
POOL_IDLE = 4.0
WINDOW_S = 1.0
CARD = ["--simulate-gpus", "1x32GiB", "--gpu-reserve", "1GiB", "--gpu-sample-interval", "0.3"]
NEVER_SLEEP = '{"neverSleep": true}'
# claim -> (column, annotation or None)
LIFECYCLES = {"plain": ("declared", None), "keep": ("neverSleep", NEVER_SLEEP),
              "quick": ("sleepAfterSeconds", '{"sleepAfterSeconds": 1}'),
              "typo": ("invalid lifecycle", '{"neverSleep": "true"}')}


class ClaimWalk:
    """The processes of the walk, what was written for each claim, and every column's checks."""

    def __init__(self, door: Door, state: Path) -> None:
        self.door = door
        self.book = state / FILE_NAME
        self.truth = Truth(door.agent.state_dir, door.agent.shm_dir)
        self.asked: dict[str, Asked] = {}
        self.outcomes: dict[tuple[str, str], str | None] = {}

    async def get(self, url: str) -> tuple[int, Any]:
        assert self.door.http is not None
        async with self.door.http.get(url) as resp:
            return resp.status, await resp.json(content_type=None)

    async def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Every sample of the reconciler's ``/metrics`` (it runs on this loop: no sync call)."""
        text = await self.door.metrics()
        return [(x.name, dict(x.labels), x.value)
                for family in text_string_to_metric_families(text) for x in family.samples]

    @property
    def api(self) -> str:
        assert self.door.app is not None
        return f"http://127.0.0.1:{self.door.app.port}"

    def engine(self, name: str) -> dict[str, Any] | None:
        snap = self.door.agent.client.snapshot()
        return next((m for m in snap["models"] if m["model_name"] == name), None)

    async def claim_moment(self, name: str) -> ClaimMoment:
        status, doc = await self.get(f"{self.api}/v1/claims/default/{name}")
        engine = self.engine(name)
        ipc = [e["ipc_name"] for e in self.door.agent.client.snapshot()["models"]]
        self.truth.sample(ipc)
        truth: dict[str, list[Any]] = {}
        if engine is not None and engine["pid"] is not None:
            rows = self.truth.rows(engine["pid"], engine["ipc_name"])
            truth = {"kv_used_bytes": rows["kv_used_bytes"],
                     "hbm_peak_bytes": sorted({*rows["hbm_peak_bytes"], *self.peaks(engine)})}
        try:
            book = list(json.loads(self.book.read_text())["footprints"])
        except FileNotFoundError:
            book = []
        return ClaimMoment(doc if status == 200 else None, book, engine, self.asked[name], truth)

    def peaks(self, engine: dict[str, Any]) -> list[int]:
        """What the engine's process reported holding at its peak (the simulated GPU)."""
        return [self.truth.peaks[engine["pid"]]] if engine["pid"] in self.truth.peaks else []

    async def column(self, table: dict[str, dict[str, str]], column: str,
                     moment: Callable[[], Any], check: Callable[[str, str, Any], str | None],
                     settle_s: float = 30.0, still: Callable[[], bool] = lambda: True) -> None:
        """Wait until every cell of ``column`` holds, then poll for ``WINDOW_S`` (while
        ``still()``): every cell must hold at every poll."""
        deadline = time.monotonic() + settle_s
        while True:
            m = await moment()
            wrong = {r: w for r, cells in table.items() if (w := check(r, cells[column], m))}
            if not wrong or time.monotonic() > deadline or not still():
                break
            await asyncio.sleep(0.05)  # the reconciler runs on this loop
        held, end = dict(wrong), time.monotonic() + WINDOW_S
        while time.monotonic() < end and still():
            await asyncio.sleep(0.05)
            m = await moment()
            for r, cells in table.items():
                if (w := check(r, cells[column], m)) is not None:
                    held.setdefault(r, w)
        for row in table:
            self.outcomes[(row, column)] = held.get(row)
        if os.environ.get("TRUTH_REPORT"):  # every column's failing cells, for editing the doc
            print(f"\n### {column}", *(f"\n   {r}: {w}" for r, w in held.items()))
            return
        assert not held, f"{column}: {held}"

    def served_by(self, before: dict[str, int], after: dict[str, int]) -> dict[str, str]:
        """The x-route-claim/-model/-agent of the engine whose request count rose."""
        rose = [n for n, count in after.items() if count > before.get(n, 0)]
        if len(rose) != 1:
            return {}
        engine = self.engine(rose[0])
        assert engine is not None
        ref = engine["claim_ref"]
        return {"x-route-claim": f"{ref['namespace']}/{ref['name']}",
                "x-route-model": rose[0], "x-route-agent": "agent-a"}

    async def call(self, name: str, streamed: bool) -> tuple[int, Any]:
        """A chat call through the door (streamed: without asking for usage); its status and
        headers, the whole answer read."""
        assert self.door.http is not None
        body = {"model": name, "messages": CHAT, "max_tokens": 4, "stream": streamed}
        async with self.door.http.post(self.door.url + "/v1/chat/completions",
                                       json=body) as resp:
            await resp.read()
            return resp.status, resp.headers

    async def usage(self, model: str) -> dict[str, int]:
        """The engine's own count of the walk's call (``usage``), asked of it directly."""
        assert self.door.http is not None
        engine = self.engine(model)
        assert engine is not None
        async with self.door.http.post(
                f"http://127.0.0.1:{engine['port']}/v1/chat/completions",
                json={"model": model, "messages": CHAT, "max_tokens": 4}) as resp:
            return dict((await resp.json())["usage"])

    async def access_line(self, before: int) -> dict[str, Any] | None:
        """The door's access line of the call made when it had ``before`` lines (None: none
        within 5 s)."""
        try:
            await self.door.until("the access line", lambda: len(self.door.access()) > before,
                                  5)
        except AssertionError:
            return None
        return self.door.access()[before]

    def counts(self) -> dict[str, int]:
        fresh = self.door.agent.client.get("/v1/runtime/snapshot?fresh=requests")
        return {m["model_name"]: m["request_success_total"] or 0 for m in fresh["models"]}


async def start(door: Door, state: Path) -> None:
    settings = DoorSettings(port=0, access_log=str(door.tmp / "access.log"))
    door.app = ReconcilerApp(Settings(door.dir, port=0, door=settings,
                                      status_dir=state / "claims-status"))
    await door.app.start()
    door.http = aiohttp.ClientSession()


@pytest.fixture
async def walk(tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> Any:
    models = tmp_path / "models"
    models.mkdir()
    agent = agent_factory(restart_delays="0.05", extra_args=[
        *CARD, "--artifact-local-root", str(models)])
    door = Door(tmp_path, agent)
    state = tmp_path / "state"
    (state / "claims-status").mkdir(parents=True)
    made = ClaimWalk(door, state)
    yield made
    await door.close()


async def test_every_cell_of_the_claims_and_routes_tables_holds_on_real_processes(
        walk: ClaimWalk, tmp_path: Path) -> None:
    claims = load_table(DOC, CLAIM_SECTION, CLAIM_COLUMNS)
    routes = load_table(DOC, ROUTE_SECTION, ROUTE_COLUMNS)
    door = walk.door
    door.pool(json.dumps({"lifecycle": {"sleepAfterSeconds": POOL_IDLE}}))
    args = {"--max-model-len": "2048", **SIM}
    for name, (_, lifecycle) in LIFECYCLES.items():
        text = labelled(name, {"family": "qwen"}) if name == "keep" else claim(name)
        door.write(name, annotated(text, lifecycle) if lifecycle else text)
        own = json.loads(lifecycle).get("sleepAfterSeconds") if lifecycle else None
        walk.asked[name] = Asked(f"huggingface://t/{name}", args, 3 * GiB, GiB,
                                 own_idle=own if isinstance(own, (int, float)) else None,
                                 pool_idle=POOL_IDLE)
    door.write("edited", annotated(claim("edited"), NEVER_SLEEP))
    walk.asked["edited"] = Asked("huggingface://t/edited", args, 3 * GiB, GiB,
                                 pool_idle=POOL_IDLE)
    model = model_dir(tmp_path / "models" / "est", QWEN3_06B,
                      {"w": ("BF16", [1024, 1024], 2)})
    est_args = {**args, "--sim-startup-seconds": "6"}
    estimate = estimate_directory(model, est_args)
    door.write("est", annotated(without_per_gpu(claim(
        "est", artifact=f"file://{model}", **{"--sim-startup-seconds": "6"})),
        NEVER_SLEEP))
    walk.asked["est"] = Asked(f"file://{model}", est_args,
                              estimate=(estimate.footprint.bytes, estimate.kv_floor.bytes),
                              pool_idle=POOL_IDLE)
    door.write("chat", route("chat", family="qwen"))
    door.write("nothing", route("nothing", family="llama"))
    await start(door, tmp_path / "state")

    def phase(name: str) -> str | None:
        st = door.status(name)
        return st.phase if st is not None else None

    def asleep(name: str) -> bool:
        return phase(name) == "Sleeping"

    await door.until("est placed", lambda: phase("est") == "Activating", 30)
    await walk.column(claims, "estimated", lambda: walk.claim_moment("est"), claim_check,
                      still=lambda: phase("est") == "Activating")
    # unmeasured: no figures and no file to estimate them from, while every GPU has engines
    door.write("remote", without_per_gpu(claim("remote")))
    walk.asked["remote"] = Asked("huggingface://t/remote", args, pool_idle=POOL_IDLE)
    await walk.column(claims, "unmeasured", lambda: walk.claim_moment("remote"), claim_check)
    for name in ("quick", "plain", "typo", "keep"):
        column = LIFECYCLES[name][0]
        if name != "keep":
            await door.until(f"{name} asleep", functools.partial(asleep, name), 40)
        await walk.column(claims, column, functools.partial(walk.claim_moment, name),
                          claim_check)
    # invalid edit: the running claim's file rewritten with a misspelt field
    await door.until("edited serving", lambda: phase("edited") == "Active", 30)
    door.write("edited", annotated(claim("edited").replace("artifactURL:", "artifactUrl:"),
                                   NEVER_SLEEP))
    await walk.column(claims, "invalid edit", functools.partial(walk.claim_moment, "edited"),
                      claim_check)
    await door.until("est serving", lambda: phase("est") == "Active", 30)
    await walk.column(claims, "measured", lambda: walk.claim_moment("est"), claim_check)

    calls: dict[str, dict[tuple[str, str], int]] = {}
    tokens: dict[tuple[str, str], int] = {}
    for column, name, streamed in (("matched", "chat", False), ("unmatched", "nothing", False),
                                   ("exact name", "keep", False), ("streamed", "chat", True)):
        warm = phase("keep") == "Active"
        before, lines = walk.counts(), len(door.access())
        status, headers = await walk.call(name, streamed)
        served = walk.served_by(before, walk.counts())
        got = {k.lower(): v for k, v in headers.items()}
        if "x-route-choice" in got:  # the kind it says, the model of the engine that served
            key = (got["x-route-choice"], served.get("x-route-model", ""))
            calls.setdefault(name, {})[key] = calls.get(name, {}).get(key, 0) + 1
        usage = await walk.usage(served["x-route-model"]) if status == 200 and served else None
        for kind in ("prompt", "completion"):
            if usage is not None:
                key = (kind, served["x-route-model"])
                tokens[key] = tokens.get(key, 0) + usage[f"{kind}_tokens"]
        line = await walk.access_line(lines)

        async def moment(n: str = name, s: int = status, h: dict[str, str] = got,
                         srv: dict[str, str] = served, w: bool = warm,
                         u: dict[str, int] | None = usage, a: dict[str, Any] | None = line,
                         made: dict[tuple[str, str], int] = dict(tokens)) -> RouteMoment:
            _, listed = await walk.get(f"{walk.api}/v1/modelroutes")
            item = next((i for i in listed["items"] if i["name"] == n), None)
            return RouteMoment(n, item, s, h, await walk.metrics(), ["default/keep"], srv, w,
                               calls.get(n, {}), made, u, a)

        await walk.column(routes, column, moment, route_check, settle_s=5.0)

    unchecked = sorted((row, col) for table, cols in ((claims, CLAIM_COLUMNS),
                                                      (routes, ROUTE_COLUMNS))
                       for row in table for col in cols if (row, col) not in walk.outcomes)
    assert not unchecked, f"cells the walk did not check: {unchecked}"


def test_a_row_of_the_claims_or_routes_tables_with_no_check_fails() -> None:
    asked = Asked("huggingface://t/m", {})
    with pytest.raises(KeyError, match="no check"):
        claim_check("spec.somethingNew", "absent", ClaimMoment(None, [], None, asked))
    with pytest.raises(KeyError, match="no check"):
        route_check("x-route-new", "absent", RouteMoment("r", None, 200, {}, [], [], {}, False,
                                                         {}))
    moment = ClaimMoment({"status": {"phase": "Active"}}, [], None, asked)
    assert claim_check("status.phase", "probably", moment) is not None
    assert claim_check("status.phase", '"Active"', moment) is None
