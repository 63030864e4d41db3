"""Recording fakes for testing an engine owner directly: no processes, no sockets.

``FakeLauncher`` hands out ``FakeProcess`` objects that record every signal and stop; a test
makes one exit when it likes. ``FakeDriver`` answers the owner's engine calls as a test sets
them and records each call. ``FakeStore`` keeps records in memory and can be told to fail like
a full or read-only disk. ``FakeStager`` is the weight cache as a test wants it. ``OwnerRig``
wires them to a real ``EngineOwner`` with a real memory broker over a simulated GPU, so what is
tested is the owner's own logic. ``RigClock`` is the owner's injected clock: real time unless a
test sets the wall time or, with ``OwnerRig.record_timers``, has every message the owner
schedules for its own inbox listed and posted at once.
"""

from __future__ import annotations

import asyncio
import copy
import errno
from typing import Any
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engines.driver import LaunchContext, Observation
from engines.client import EngineCallError
from engines.process import ExitInfo
from runtime_agent.artifacts.staging import StagingFailed, StagingView
from runtime_agent.artifacts.verify import Progress
from registry.record import EngineRecord, EngineSpec
from runtime_agent.gpu.broker import MemoryBroker
from runtime_agent.gpu.simulated import SimulatedGpuBackend
from runtime_agent.settings import Settings
from runtime_agent.supervision.messages import Intent, StartMode
from runtime_agent.supervision.outcomes import Outcome
from contract.clock import Timer
from runtime_agent.supervision.owner import EngineOwner, OwnerDeps
from runtime_agent.supervision.owner.port import Posted
from runtime_agent.supervision.views import EngineEvent, EngineView


class FakeProcess:
    """An engine process as the owner sees it; ``calls`` records what was done to it."""

    def __init__(self, pid: int, stop_takes_s: float = 0.0, dies_on_term: bool = True) -> None:
        self.pid = pid
        self.start_time = 1000 + pid
        self.is_child = True
        self.exited: asyncio.Future[ExitInfo] = asyncio.get_running_loop().create_future()
        self.calls: list[str] = []
        self._stop_takes_s = stop_takes_s
        self._dies_on_term = dies_on_term

    def exit(self, code: int | None = 1, sig: int | None = None) -> None:
        """The engine ends on its own (a crash)."""
        if not self.exited.done():
            self.exited.set_result(ExitInfo(code if sig is None else None, sig, time.monotonic()))

    def signal_group(self, sig: int) -> None:
        self.calls.append(f"signal_group:{signal.Signals(sig).name}")
        if sig == signal.SIGKILL:
            self.exit(None, signal.SIGKILL)

    async def stop(self, grace_s: float) -> ExitInfo:
        self.calls.append(f"stop:{grace_s:g}")
        if self._dies_on_term:
            await asyncio.sleep(min(self._stop_takes_s, grace_s))
            self.exit(None, signal.SIGTERM)
        else:
            await asyncio.sleep(grace_s)
            self.exit(None, signal.SIGKILL)
        return await self.exited

    def close(self) -> None:
        self.calls.append("close")


class FakeLauncher:
    def __init__(self) -> None:
        self.spawned: list[FakeProcess] = []
        self.argv: list[list[str]] = []
        self.env: list[dict[str, str]] = []
        self.log_paths: list[Path] = []  # where each process's output was sent
        self.fail_with: Exception | None = None
        self.leftovers_fail: OSError | None = None  # the leftover sweep fails like this
        self.alive: dict[int, FakeProcess] = {}
        self.leftovers_killed: list[str] = []  # engine ids, in order
        self.leftovers_in: list[str] = []  # the state directory each sweep was told
        self._next_pid = 4000

    async def spawn(self, argv: list[str], env: Mapping[str, str], log_path: Path) -> FakeProcess:
        if self.fail_with is not None:
            raise self.fail_with
        self._next_pid += 1
        proc = FakeProcess(self._next_pid)
        self.spawned.append(proc)
        self.argv.append(list(argv))
        self.env.append(dict(env))
        self.log_paths.append(log_path)
        self.alive[proc.pid] = proc
        return proc

    def attach(self, pid: int) -> FakeProcess | None:
        return self.alive.get(pid)

    def kill_leftovers(self, state_dir: str, engine_id: str) -> list[int]:
        if self.leftovers_fail is not None:
            raise self.leftovers_fail
        self.leftovers_killed.append(engine_id)
        self.leftovers_in.append(state_dir)
        return []

    @property
    def last(self) -> FakeProcess:
        return self.spawned[-1]


@dataclass
class FakeDriver:
    """The engine's HTTP API as a test wants it to answer; ``calls`` in order."""

    kind: str = "vllm"
    healthy_answer: bool = True
    sleeping: bool = False
    sleep_error: str | None = None
    wake_error: str | None = None
    call_takes_s: float = 0.0
    calls: list[str] = field(default_factory=list)
    hold: asyncio.Event | None = None  # when set, sleep and wake wait for it
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters the engine serves
    probe_hangs: bool = False  # health probes get no answer (a stopped or hung engine)
    probes: int = 0
    figures: Observation = field(default_factory=lambda: Observation(running=0, waiting=0,
                                                                     success_total=0))

    def command(self, record: EngineRecord, ctx: LaunchContext) -> tuple[list[str], dict[str, str]]:
        """Started on the weight cache's copy when there is one, as the real drivers are."""
        return ["fake-engine", ctx.model_path or record.spec.artifact_url], dict(ctx.extra_env)

    def sleep_unsupported(self) -> str | None:
        return None

    async def healthy(self, timeout_s: float, asleep: bool = False) -> bool:
        self.calls.append("healthy")
        return self.healthy_answer

    async def probe(self, timeout_s: float, asleep: bool) -> tuple[bool, bool | None]:
        self.probes += 1
        if self.probe_hangs:
            await asyncio.sleep(timeout_s)
            return False, None
        return self.healthy_answer, self.sleeping

    async def prepare(self, timeout_s: float) -> bool:
        self.calls.append("prepare")
        return True

    async def is_sleeping(self, timeout_s: float) -> bool | None:
        return self.sleeping

    async def sleep(self, level: int, timeout_s: float) -> None:
        self.calls.append(f"sleep:{level}")
        await self._wait()
        if self.sleep_error:
            raise EngineCallError(self.sleep_error)
        self.sleeping = True

    async def wake(self, from_level: int, timeout_s: float) -> None:
        self.calls.append(f"wake:{from_level}")
        await self._wait()
        if self.wake_error:
            raise EngineCallError(self.wake_error)
        self.sleeping = False

    async def _wait(self) -> None:
        if self.hold is not None:
            await self.hold.wait()
        await asyncio.sleep(self.call_takes_s)

    async def observe(self, timeout_s: float) -> Observation | None:
        return self.figures

    async def load_adapter(self, name: str, path: str, timeout_s: float) -> None:
        self.calls.append(f"load_adapter:{name}")
        self.adapters[name] = path

    async def unload_adapter(self, name: str, timeout_s: float) -> None:
        self.calls.append(f"unload_adapter:{name}")
        if self.adapters.pop(name, None) is None:
            raise EngineCallError(f"The lora adapter '{name}' cannot be found.", 404)

    async def loaded_adapters(self, timeout_s: float) -> dict[str, str] | None:
        return dict(self.adapters)

    async def close(self) -> None:
        self.calls.append("close")


class FakeStore:
    """Records in memory; ``fail`` makes every write raise like a full or read-only disk."""

    def __init__(self) -> None:
        self.records: dict[str, EngineRecord] = {}
        self.saves = 0
        self.fail: int | None = None  # an errno, e.g. errno.ENOSPC: writes fail
        self.fail_delete: int | None = None  # unlinks fail too (EROFS)

    def save(self, record: EngineRecord) -> None:
        if self.fail is not None:
            raise OSError(self.fail, errno.errorcode.get(self.fail, "error"))
        self.saves += 1
        self.records[record.engine_id] = copy.deepcopy(record)

    def delete(self, engine_id: str) -> None:
        if self.fail_delete is not None:
            raise OSError(self.fail_delete, errno.errorcode.get(self.fail_delete, "error"))
        self.records.pop(engine_id, None)


class FakeStager:
    """The weight cache: ``cached`` artifacts start at once from their path; any other is
    staged when ``staged`` is set (``progress`` reported first), failing with ``error``."""

    def __init__(self) -> None:
        self.cached: dict[str, str] = {}  # artifact URL -> the entry's directory
        self.progress = Progress(total=1000)
        self.staged = asyncio.Event()
        self.error: str | None = None
        self.to: str = "/cache/entry"  # where a staged artifact lands

    def model_path(self, spec: EngineSpec) -> str | None:
        return self.cached.get(spec.artifact_url)

    def must_stage(self, spec: EngineSpec) -> bool:
        return spec.artifact_url not in self.cached

    async def stage(self, spec: EngineSpec, on_start: Callable[[StagingView], None] | None = None,
                    credentials: dict[str, str] | None = None) -> str:
        if on_start is not None:
            on_start(StagingView("entry-1", spec.artifact_url, self.progress))
        await self.staged.wait()
        if self.error is not None:
            raise StagingFailed(self.error)
        self.cached[spec.artifact_url] = self.to
        return self.to


class RigClock:
    """The owner's clock in tests: the loop's time and timers, but ``wall_at`` (when set) is
    the wall time, and once ``recording`` every message scheduled for the owner's inbox (a
    restart's backoff, a port retry, a record write retried, a revive) is kept in ``timers``
    with its delay and posted at once, so a test walks through backoffs without waiting."""

    def __init__(self) -> None:
        self.wall_at: float | None = None
        self.recording = False
        self.timers: list[tuple[float, object]] = []  # (delay, message) the owner scheduled

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time() if self.wall_at is None else self.wall_at

    def later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        if self.recording and isinstance(callback, Posted):
            self.timers.append((delay_s, callback.message))
            delay_s = 0
        return asyncio.get_running_loop().call_later(max(0.0, delay_s), callback)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class OwnerRig:
    """One real ``EngineOwner`` over the fakes; events and views are kept for assertions."""

    def __init__(self, tmp: Path, settings: Settings | None = None,
                 driver: FakeDriver | None = None) -> None:
        self.settings = settings or fast_settings(tmp)
        self.launcher = FakeLauncher()
        self.driver = driver or FakeDriver()
        self.store = FakeStore()
        self.events: list[EngineEvent] = []
        self.views: list[EngineView] = []
        backend = SimulatedGpuBackend("1x80GiB", tmp / "sim-gpu")
        self.memory = MemoryBroker(backend, dict, 0, 0, 3600)
        self.port_free = True
        self.clock = RigClock()
        self.deps = OwnerDeps(settings=self.settings, store=self.store,  # type: ignore[arg-type]
                              launcher=self.launcher,  # type: ignore[arg-type]
                              driver_for=lambda record: self.driver,  # type: ignore[arg-type,return-value]
                              on_event=self.events.append, on_view=self.views.append,
                              memory=self.memory, port_free=lambda port, host: self.port_free,
                              clock=self.clock)
        self.owner: EngineOwner | None = None

    @property
    def timers(self) -> list[tuple[float, object]]:
        return self.clock.timers

    def record_timers(self) -> None:
        """From now on, record every message an owner schedules for its own inbox (a restart's
        backoff, a port retry, a revive) with its delay, and post it at once instead of after
        the delay, so a test walks through backoffs without waiting them out (``RigClock``)."""
        self.clock.recording = True

    def told_memory(self, what: str) -> list[str]:
        """The engines the owner tells the memory broker ``what`` (``stopped``: its memory is
        free; ``exited``: its process is gone), in order, from now on."""
        told: list[str] = []
        real = getattr(self.memory, what)

        def spying(key: str) -> None:
            told.append(key)
            real(key)

        setattr(self.memory, what, spying)
        return told

    def scheduled(self, kind: type) -> list[tuple[float, Any]]:
        return [(delay, message) for delay, message in self.timers if isinstance(message, kind)]

    def start(self, record: EngineRecord | None = None, mode: StartMode = StartMode.SPAWN,
              pid: int | None = None) -> EngineOwner:
        self.owner = EngineOwner(record or make_record(), self.deps)
        self.owner.start(mode, pid)
        return self.owner

    async def ask(self, intent: Intent) -> Outcome:
        assert self.owner is not None
        return await asyncio.wait_for(self.owner.request(intent), 30)

    async def until(self, check: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
        """Wait, by loop time, until ``check()`` holds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not check():
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.001)

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]

    async def close(self) -> None:
        if self.owner is not None:
            await self.owner.detach()
        await self.memory.close()


def fast_settings(tmp: Path, **overrides: object) -> Settings:
    base: dict[str, object] = dict(
        state_dir=tmp / "state", kv_shm_dir=tmp / "shm", restart_delays=(2, 4, 8, 16, 32),
        probe_first_s=0.001, probe_max_s=0.01, stop_grace_s=10.0, scrape_interval_s=3600,
        kv_watch_s=0.01, kv_hold_s=1.0, start_stall_s=600.0)
    base.update(overrides)
    (tmp / "shm").mkdir(exist_ok=True)
    (tmp / "state" / "logs").mkdir(parents=True, exist_ok=True)
    return Settings(**base)  # type: ignore[arg-type]


def make_record(name: str = "m1", engine_id: str = "e" * 16, **fields: object) -> EngineRecord:
    spec = EngineSpec(model_name=name, artifact_url="hf://org/m", engine="vllm",
                      ipc_name=f"kvc_{name}")
    base: dict[str, object] = dict(port=20000, created_at=1.0, last_transition=1.0)
    base.update(fields)
    return EngineRecord(engine_id=engine_id, spec=spec, **base)  # type: ignore[arg-type]
