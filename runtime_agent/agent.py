"""The agent: wires settings, registry, launcher, pool, events and the HTTP API together.

Start-up order matters: the registry is read and every engine the previous agent left running
is re-adopted before the API accepts a request, so no activation can race with re-adoption.
Shutdown leaves engines running; only a deactivate stops an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from msgspec.structs import replace
from prometheus_client import disable_created_metrics

from contract.clock import LoopClock
from contract.phases import Phase
from engine_http.upstream import Upstream
from engines.cgroups import EngineCgroups
from engines.process import ProcessLauncher, tail_lines, trim_log
from guard.conns import API_LIMITS, GuardedSite, quiet_accept_errors
from registry.store import RegistryStore
from runtime_agent import __version__
from runtime_agent.api.app import make_app
from runtime_agent.api.events import EventLog
from runtime_agent.api.limits import Slots
from runtime_agent.api.metrics import AgentMetrics, memory_families
from runtime_agent.api.probes import ProbeServer
from runtime_agent.api.snapshot import build_snapshot, memory_entry, short_entry
from runtime_agent.gpu.backend import GpuBackend, GpuUnavailable
from runtime_agent.gpu.broker import EngineRef, MemoryBroker
from runtime_agent.gpu.nvml import NvmlBackend
from runtime_agent.gpu.simulated import SimulatedGpuBackend
from runtime_agent.loops import Throttled, keep_running, run_stages
from runtime_agent.settings import Settings
from runtime_agent.statelock import StateLock
from runtime_agent.supervision.durability import StorageHealth
from runtime_agent.supervision.engine_kinds import make_driver
from runtime_agent.supervision.messages import StartMode
from runtime_agent.supervision.owner import OwnerDeps
from runtime_agent.supervision.pool import EnginePool
from runtime_agent.supervision.ports import ephemeral_range, overlaps_ephemeral
from runtime_agent.supervision.recovery import Step, recover
from runtime_agent.supervision.views import EngineEvent, EngineView

if TYPE_CHECKING:  # the weight cache's modules load with the cache (make_cache)
    from runtime_agent.artifacts.cache import ArtifactCache
    from runtime_agent.artifacts.staging import EngineStager

log = logging.getLogger(__name__)

# Threads for blocking calls (record writes, spawns, /proc scans): see ``serve``.
BLOCKING_THREADS = 32

# Seconds each shutdown stage may take (17 s in all, inside Kubernetes' default 30 s grace).
STOP_STAGE_S = {"api": 4.0, "loops": 2.0, "engines": 5.0, "artifacts": 3.0, "gpu": 2.0,
                "clients": 1.0}


class Agent:
    def __init__(self, settings: Settings, sockets: list[socket.socket] | None = None,
                 probe_sockets: list[socket.socket] | None = None) -> None:
        self.settings = settings
        # The API's sockets, bound by the start-up checks (``runtime_agent.preflight``): the
        # port found free there is the one served here. None: bind host:port at the end.
        self._sockets = sockets or []
        # The probes' own port (--health-probe-port), answered from their own threads.
        self.probes = ProbeServer(probe_sockets, self._probe_report,
                                  stall_after_s=settings.probe_stall_s) if probe_sockets else None
        self.events = EventLog()
        self.storage = StorageHealth()  # what owners last found writing the state directory
        self.streams = Slots(64, "event streams")
        self.waiters = Slots(512, "event long-polls")
        # The weight cache (issue 14); None when AIBRIX_WEIGHT_CACHE_DIR is not set.
        self.artifacts = make_cache(settings, self.events, self._artifact_users)
        self.started_at = time.time()
        # The agent's own process: no *_created series, as vLLM does.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.metrics = AgentMetrics(lambda: self.pool.views(), lambda: itertools.chain(
            memory_families(self), self.artifacts.metric_families() if self.artifacts else ()))
        self._runner: web.AppRunner | None = None
        self._http: Upstream | None = None  # every HTTP call to an engine (engine_http)
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = StateLock(settings.state_dir)
        self._views_version = 0  # bumps with every changed engine view: what rendered() keys on
        self._rendered: dict[str, tuple[tuple[int, int, int], bytes, str]] = {}
        self._recovered_at: float | None = None  # monotonic time re-adoption was planned
        self._taken_over: list[str] = []  # models whose engines the previous agent left
        self.pool: EnginePool
        self.memory: MemoryBroker

    async def start(self) -> None:
        s = self.settings
        engine_cwd = s.state_dir.absolute() / "engine-cwd"  # empty: see ProcessLauncher
        for path in (s.state_dir, s.engines_dir, s.logs_dir, engine_cwd):
            # Private: records hold activation credentials, logs hold what engines print.
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if path.stat().st_mode & 0o777 != 0o700:  # (a read-only one starts when it is so)
                path.chmod(0o700)
        self._lock.acquire()  # before the registry is read: one agent per state directory
        if self.probes is not None:  # "reading the registry" from here on, not a refused port
            await self.probes.start()
        if overlaps_ephemeral(s.port_low, s.port_high, ephemeral_range()):
            log.warning("engine ports %d-%d overlap the kernel's ephemeral port range %s: an "
                        "outgoing connection can take an engine's port; pick a range below it",
                        s.port_low, s.port_high, "-".join(map(str, ephemeral_range())))
        store = RegistryStore(s.state_dir)
        backend, sim_dir = await asyncio.to_thread(make_gpu_backend, s)
        self.settings = s = replace(s, sim_gpu_dir=sim_dir)
        clock = LoopClock()  # the one clock the broker, the owners and their watchers wait on
        self.memory = MemoryBroker(backend, self._engine_refs, s.gpu_reserve_bytes,
                                   s.host_reserve_bytes, s.gpu_sample_interval_s,
                                   s.gpu_sample_interval_s * s.steady_backoff, clock)
        # no stall clock of the pool's own: every control call brings its own deadline
        self._http = http = Upstream(timeout=None)
        cgroups = await asyncio.to_thread(engine_cgroups, s)
        deps = OwnerDeps(settings=s, store=store, launcher=ProcessLauncher(engine_cwd, cgroups),
                         driver_for=lambda record: make_driver(s, http, record),
                         on_event=self._on_event, on_view=self._on_view, memory=self.memory,
                         stager=_stager(self.artifacts),
                         storage=self.storage, throttled=Throttled(log), clock=clock)
        self.pool = EnginePool(deps)
        await self.memory.start()
        if self.artifacts is not None:
            await self.artifacts.start()
        loaded, steps = await recover(store, str(s.state_dir), s.kv_shm_dir)
        if cgroups is not None:  # engines whose leader died while no agent watched: all of them
            live = {step.record.engine_id for step in steps
                    if step.mode is StartMode.ADOPT and step.pid is not None}
            for engine_id in await asyncio.to_thread(cgroups.sweep, live):
                log.warning("killed what was left in engine %s's cgroup: its leader is gone",
                            engine_id)
        for step in steps:  # taken-over engines keep their place on their cards
            rec = step.record
            if step.mode is StartMode.ADOPT and step.pid is not None \
                    and rec.hbm_peak_pid == step.pid and rec.hbm_peak_bytes is not None:
                self.memory.adopt_peak(rec.spec.model_name, step.pid, rec.hbm_peak_bytes)
            if step.mode in (StartMode.ADOPT, StartMode.RESTART) and rec.devices:
                self.memory.adopt(rec.spec.model_name, tuple(rec.devices),
                                  rec.per_gpu.need_bytes if rec.per_gpu else 0,
                                  rec.phase is Phase.SLEEPING)
        self.pool.adopt(steps)
        self._taken_over = [step.record.spec.model_name for step in steps]
        self._recovered_at = time.monotonic()
        self.metrics.count_readoptions(_readoption_result(step) for step in steps)
        log.info("registry: %d records, %d quarantined; %d engines taken over",
                 len(loaded.records), len(loaded.quarantined), len(steps))
        self._tasks.append(asyncio.create_task(
            keep_running("engine-log trimming", self._trim_logs, Throttled(log)),
            name="trim-logs"))
        if self.artifacts is not None:
            self._tasks.append(asyncio.create_task(self._preload_when_settled(self.artifacts),
                                                   name="preload-clients"))
        self._runner = web.AppRunner(make_app(self), access_log=None, handle_signals=False,
                                     shutdown_timeout=2.0)
        await self._runner.setup()
        # a connection cap (an eighth of the fd soft limit at most) and a deadline for the first
        # request head: the API must not share the door's fate (guard/conns.py)
        sites = [GuardedSite(self._runner, API_LIMITS, sock=sock) for sock in self._sockets]
        for site in sites or [GuardedSite(self._runner, API_LIMITS, host=s.host, port=s.port)]:
            await site.start()
        log.info("runtime agent %s listening on %s:%d, state in %s", __version__, s.host, s.port,
                 s.state_dir)

    async def stop(self) -> list[str]:
        """Close the API and let go of engines; they keep running for the next agent.

        Stages run in order, each with its own timeout, so one that hangs (a client that holds
        a long poll, an NVML call stuck in the driver) cannot keep the lock from being released
        inside Kubernetes' grace period; returns the stages that did not finish."""
        async def cancel_tasks() -> None:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        async def nothing() -> None:
            return None

        runner, artifacts, http, probes = self._runner, self.artifacts, self._http, self.probes

        async def close_http() -> None:
            if http is not None:
                http.close()

        self.events.close()  # its followers answered now: closing the API waits for no one
        unfinished = await run_stages([
            ("closing the API", STOP_STAGE_S["api"], runner.cleanup if runner else nothing),
            ("closing the probes", STOP_STAGE_S["api"], probes.close if probes else nothing),
            ("stopping background loops", STOP_STAGE_S["loops"], cancel_tasks),
            ("letting go of engines", STOP_STAGE_S["engines"], self.pool.close),
            ("closing the weight cache", STOP_STAGE_S["artifacts"],
             artifacts.close if artifacts else nothing),
            ("closing the GPU backend", STOP_STAGE_S["gpu"], self.memory.close),
            ("closing HTTP clients", STOP_STAGE_S["clients"], close_http),
        ], log)
        self._lock.release()
        return unfinished

    # ---- readers ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        agent = {"version": __version__, "state_dir": str(self.settings.state_dir),
                 "started_at": self.started_at, "simulated_engines": self.settings.simulate_engines}
        cache = self.artifacts
        snap = build_snapshot(self.pool.views(), cache.ready_urls() if cache else [], agent,
                              self.memory)
        # Strings stay strings for AIBrix's decoder; sizes and revisions go beside them.
        snap["cached_artifact_details"] = cache.ready_sizes() if cache else []
        snap["artifacts_staging"] = cache.downloading_urls() if cache else []
        return snap

    def health(self) -> dict[str, Any]:
        """``/healthz``: ok, or degraded with what is wrong (still 200: a restart of the agent
        would not mend a full disk, and the engines are still supervised)."""
        problem = self.storage.problem
        if problem is None:
            return {"status": "ok", "boot_id": self.events.boot_id}
        return {"status": "degraded", "boot_id": self.events.boot_id, "conditions": [
            {"type": "StorageUnavailable", "message": f"the state directory cannot be written: "
             f"{problem}; engines are still supervised, changes are refused until it can"}]}

    def _probe_report(self) -> tuple[dict[str, Any], str | None]:
        return self.health(), self.not_ready_reason()

    async def _preload_when_settled(self, artifacts: ArtifactCache) -> None:
        """The weight cache's client imports, once every taken-over engine has shown its first
        state (or the settle timeout passed): re-adoption first."""
        settling = [asyncio.shield(o.settled) for name in self._taken_over
                    if (o := self.pool.owners.get(name)) is not None]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*settling), self.settings.settle_timeout_s)
        artifacts.preload_clients()

    def not_ready_reason(self) -> str | None:
        """Why ``/ready`` is not 200 yet: the registry unread, or engines still being taken
        over (each until its first state is known, at most ``settle_timeout_s``)."""
        if self._recovered_at is None:
            return "reading the registry"
        if time.monotonic() - self._recovered_at >= self.settings.settle_timeout_s:
            return None
        pending = sorted(name for name in self._taken_over
                         if (o := self.pool.owners.get(name)) is not None and not o.settled.done())
        if pending:
            return f"re-adopting {len(pending)} engine(s): {', '.join(pending[:8])}"
        return None

    def rendered(self, what: str) -> tuple[bytes, str]:
        """The snapshot (``"snapshot"``) or the model list (``"models"``) as JSON bytes and its
        ETag, rendered once per change: an engine's view, an event or a GPU sample (every
        second) makes a new version; readers in between get the same bytes."""
        version = (self._views_version, self.events.last_seq, self.memory.samples_total)
        cached = self._rendered.get(what)
        if cached is None or cached[0] != version:
            body = self.snapshot() if what == "snapshot" else self.model_list()
            etag = f'W/"{self.events.boot_id}-{"-".join(map(str, version))}"'
            cached = (version, json.dumps(body).encode(), etag)
            self._rendered[what] = cached
        return cached[1], cached[2]

    def model_list(self) -> dict[str, Any]:
        views = sorted(self.pool.views(), key=lambda v: v.spec.model_name)
        return {"models": [{**short_entry(v), **memory_entry(self.memory.figures.get(
            v.spec.model_name), v)} for v in views]}

    async def log_tail(self, model_name: str, lines: int) -> list[str] | None:
        owner = self.pool.owners.get(model_name)
        if owner is None:
            return None
        return await asyncio.to_thread(tail_lines, owner.log_path, lines, 256 * lines + 4096)

    # ---- hooks from owners ------------------------------------------------------------------

    def _on_event(self, event: EngineEvent) -> None:
        self.events.append(event)
        self.metrics.on_event(event)
        self.memory.poke()  # every change is worth a fresh GPU sample

    def _engine_refs(self) -> dict[str, EngineRef]:
        refs = {}
        for v in self.pool.views():
            asleep = v.phase is Phase.SLEEPING or v.operation == "sleep"
            steady = v.phase in (Phase.ACTIVE, Phase.SLEEPING) and v.operation is None
            refs[v.spec.model_name] = EngineRef(v.pid, v.devices, asleep, steady,
                                                v.last_transition)
        return refs

    def _on_view(self, view: EngineView) -> None:
        self._views_version += 1

    def _artifact_users(self) -> list[tuple[str, str, str | None]]:
        """Engines that may read their weights now: their cache entries are never evicted."""
        if not hasattr(self, "pool"):
            return []
        from runtime_agent.artifacts.staging import engine_users  # loaded with the cache

        return engine_users((v.spec.model_name, v.spec) for v in self.pool.views()
                            if v.phase not in (Phase.STOPPED, Phase.FAILED))

    async def _trim_logs(self) -> None:
        while True:
            await asyncio.sleep(self.settings.log_check_interval_s)
            for owner in list(self.pool.owners.values()):
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(trim_log, owner.log_path, self.settings.log_max_bytes)


def make_gpu_backend(settings: Settings) -> tuple[GpuBackend, Path | None]:
    """NVML when it finds a GPU; the simulated GPU otherwise (or when asked for)."""
    if settings.gpu_backend in ("auto", "nvml"):
        try:
            return NvmlBackend(), None
        except GpuUnavailable as exc:
            if settings.gpu_backend == "nvml":
                raise
            log.warning("GPU memory is SIMULATED: no GPU through NVML (%s); simulating %s",
                        exc, settings.simulate_gpus)
    channel = settings.state_dir / "sim-gpu"
    return SimulatedGpuBackend(settings.simulate_gpus, channel), channel


def make_cache(settings: Settings, events: EventLog,
               users: Callable[[], list[tuple[str, str, str | None]]]) -> ArtifactCache | None:
    if settings.weight_cache_dir is None:
        return None
    # The cache's modules load only when it is configured: a plain serve does not read them.
    from runtime_agent.artifacts.cache import ArtifactCache, CacheConfig

    config = CacheConfig(settings.weight_cache_dir, settings.artifact_reserve_bytes,
                         settings.artifact_local_roots, settings.hf_endpoint, settings.hf_token,
                         settings.s3_endpoint_url)
    return ArtifactCache(config, users=users, on_event=events.append)


def _stager(artifacts: ArtifactCache | None) -> EngineStager | None:
    if artifacts is None:
        return None
    from runtime_agent.artifacts.staging import EngineStager

    return EngineStager(artifacts)


def _readoption_result(step: Step) -> str:
    if step.mode is StartMode.ADOPT:
        return "rebuilt" if step.rebuilt else "adopted"
    return {StartMode.RESTART: "restarted", StartMode.IDLE: "failed"}.get(step.mode, "stopped")


def engine_cgroups(settings: Settings) -> EngineCgroups | None:
    """The engines' cgroups, when enabled and possible; says which way engines are contained."""
    if not settings.engine_cgroups:
        log.info("engine cgroups off: an engine is its process group and its engine id")
        return None
    cgroups, where = EngineCgroups.discover(str(settings.state_dir))
    if cgroups is None:
        log.info("engine cgroups unavailable (%s): an engine is its process group and its "
                 "engine id", where)
    else:
        log.info("each engine runs in its own cgroup under %s", where)
    return cgroups


class Companion(Protocol):
    """A server that runs beside the agent and talks to its API (the embedded reconciler of
    ``serve --claims``): started once the API listens, stopped before the API closes."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def serve(settings: Settings, sockets: list[socket.socket] | None = None,
                probe_sockets: list[socket.socket] | None = None,
                companion: Companion | None = None,
                started: Callable[[], None] | None = None) -> None:
    """Run the agent until SIGTERM or SIGINT; ``started`` is called once the API listens."""
    loop = asyncio.get_running_loop()
    quiet_accept_errors(loop)  # out of descriptors: one line a minute, not a traceback each
    # Record writes (fsync), spawns and /proc scans wait on the disk and the kernel, not the
    # CPU; asyncio's default of cores + 4 threads (6 here) queued 64 activations sent together
    # behind each other's fsyncs. Threads start only when work waits for one.
    loop.set_default_executor(ThreadPoolExecutor(BLOCKING_THREADS, "agent-blocking"))
    agent = Agent(settings, sockets, probe_sockets)
    await agent.start()
    if started is not None:
        started()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if companion is not None:
            await companion.start()
        await stop.wait()
        log.info("stopping the agent; engines keep running")
    finally:
        if companion is not None:
            await companion.stop()
        await agent.stop()
