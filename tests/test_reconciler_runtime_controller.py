"""The controller: the reconcile contract, its retries and requeues, metrics and shutdown."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterable

import pytest
from prometheus_client import CollectorRegistry

from reconciler.runtime.controller import Controller, Result, TerminalError
from reconciler.runtime.metrics import ControllerMetrics
from reconciler.runtime.queue import WorkQueue
from reconciler.runtime.sources import TimerSource
from tests.clocks import FakeClock

pytestmark = [pytest.mark.timeout(30), pytest.mark.loop_guard]

Key = tuple[str, str, str]
Outcome = Result | Exception


def claim(name: str) -> Key:
    return ("ModelClaim", "default", name)


async def settle(rounds: int = 30) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


class ScriptedReconciler:
    """Answers each call with the key's next scripted outcome (then ``Result()``), recording
    when it was called, how many calls of one key overlapped, and whether one was cancelled."""

    def __init__(self, clock: FakeClock, script: dict[Key, list[Outcome]] | None = None,
                 forever: dict[Key, Outcome] | None = None) -> None:
        self.clock = clock
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.forever = forever or {}
        self.gates: dict[Key, asyncio.Event] = {}
        self.calls: list[tuple[float, Key]] = []
        self.running: Counter[Key] = Counter()
        self.most_at_once_per_key = 0
        self.most_at_once = 0
        self.cancelled: list[Key] = []
        self.finished: list[Key] = []

    def times(self, key: Key) -> list[float]:
        return [at for at, k in self.calls if k == key]

    async def reconcile(self, key: Key) -> Result:
        self.calls.append((self.clock.now(), key))
        self.running[key] += 1
        self.most_at_once_per_key = max(self.most_at_once_per_key, self.running[key])
        self.most_at_once = max(self.most_at_once, sum(self.running.values()))
        try:
            if key in self.gates:
                await self.gates[key].wait()
            for _ in range(3):
                await asyncio.sleep(0)  # let other workers interleave
        except asyncio.CancelledError:
            self.cancelled.append(key)
            raise
        finally:
            self.running[key] -= 1
        self.finished.append(key)
        outcome = self.forever.get(key) or (self.script.get(key) or [Result()]).pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def make(clock: FakeClock, registry: CollectorRegistry, reconciler: ScriptedReconciler,
         workers: int = 1) -> Controller[Key]:
    return Controller("claims", reconciler, WorkQueue(clock), workers=workers, clock=clock,
                      metrics=registry)


@pytest.fixture
async def stop_after() -> AsyncIterator[list[Controller[Key]]]:
    started: list[Controller[Key]] = []
    yield started
    for controller in started:
        await controller.stop()


async def run_clock_to_next_wakeup(clock: FakeClock) -> None:
    await settle()
    deadline = clock.next_deadline()
    assert deadline is not None, "nothing is waiting on the clock"
    clock.advance(deadline - clock.now())
    await settle()


def totals(registry: CollectorRegistry) -> dict[str, float | None]:
    return {r: registry.get_sample_value("reconcile_total", {"controller": "claims", "result": r})
            for r in ("success", "error", "requeue", "terminal")}


# -- one worker per key ----------------------------------------------------------------------------

async def test_one_key_is_never_reconciled_by_two_workers_at_once(
        clock: FakeClock, registry: CollectorRegistry,
        stop_after: list[Controller[Key]]) -> None:
    reconciler = ScriptedReconciler(clock)
    controller = make(clock, registry, reconciler, workers=8)
    controller.start()
    stop_after.append(controller)
    keys = [claim(n) for n in "abc"]
    for _ in range(50):
        for key in keys:
            controller.queue.add(key)
        await asyncio.sleep(0)
    await settle(100)
    assert reconciler.most_at_once_per_key == 1
    assert reconciler.most_at_once > 1  # different keys did run side by side
    assert set(k for _, k in reconciler.calls) == set(keys)


async def test_adds_during_a_reconcile_collapse_into_exactly_one_more_run(
        clock: FakeClock, registry: CollectorRegistry,
        stop_after: list[Controller[Key]]) -> None:
    reconciler = ScriptedReconciler(clock)
    key = claim("a")
    reconciler.gates[key] = asyncio.Event()
    controller = make(clock, registry, reconciler, workers=4)
    controller.start()
    stop_after.append(controller)
    controller.queue.add(key)
    await settle()
    for _ in range(5):
        controller.queue.add(key)
    await settle()
    assert len(reconciler.calls) == 1
    reconciler.gates[key].set()
    await settle()
    assert [k for _, k in reconciler.calls] == [key, key]
    assert reconciler.most_at_once_per_key == 1


# -- outcomes --------------------------------------------------------------------------------------

async def test_a_failing_key_is_retried_after_5ms_10ms_20ms_up_to_1000s(
        clock: FakeClock, registry: CollectorRegistry,
        stop_after: list[Controller[Key]]) -> None:
    key = claim("broken")
    reconciler = ScriptedReconciler(clock, forever={key: RuntimeError("engine refused")})
    controller = make(clock, registry, reconciler)
    controller.start()
    stop_after.append(controller)
    controller.queue.add(key)
    for _ in range(21):
        await run_clock_to_next_wakeup(clock)
    times = reconciler.times(key)
    gaps = [round(b - a, 6) for a, b in zip(times, times[1:])]
    assert gaps[:4] == [0.005, 0.01, 0.02, 0.04]
    assert gaps == [min(1000.0, round(0.005 * 2**n, 6)) for n in range(21)]
    assert gaps[-3:] == [1000.0] * 3
    assert controller.queue.failures(key) == 22


async def test_success_forgets_the_failures_so_the_next_error_retries_after_5ms(
        clock: FakeClock, registry: CollectorRegistry,
        stop_after: list[Controller[Key]]) -> None:
    key = claim("flaky")
    boom = RuntimeError("boom")
    reconciler = ScriptedReconciler(clock, {key: [boom, boom, boom, Result(), boom, Result()]})
    controller = make(clock, registry, reconciler)
    controller.start()
    stop_after.append(controller)
    controller.queue.add(key)
    for _ in range(3):
        await run_clock_to_next_wakeup(clock)
    assert len(reconciler.calls) == 4 and controller.queue.failures(key) == 0
    controller.queue.add(key)  # a new change, and a new failure
    await settle()
    assert controller.queue.waiting[key] - clock.now() == pytest.approx(0.005)
    await run_clock_to_next_wakeup(clock)
    assert len(reconciler.calls) == 6 and controller.queue.failures(key) == 0


async def test_a_terminal_error_is_recorded_and_not_retried(
        clock: FakeClock, registry: CollectorRegistry,
        stop_after: list[Controller[Key]]) -> None:
    key = claim("invalid")
    error = TerminalError("artifact_url must be an s3:// or hf:// URL")
    reconciler = ScriptedReconciler(clock, {key: [RuntimeError("transient"), error]})
    controller = make(clock, registry, reconciler)
    controller.start()
    stop_after.append(controller)
    controller.queue.add(key)
    await run_clock_to_next_wakeup(clock)  # the retry after the transient error
    assert controller.last_terminal_error(key) is error
    assert controller.queue.failures(key) == 0 and controller.queue.waiting == {}
    clock.advance(5000.0)
    await settle()
    assert len(reconciler.calls) == 2
    controller.queue.add(key)  # the spec was fixed: the next run succeeds and clears the record
    await settle()
    assert len(reconciler.calls) == 3 and controller.last_terminal_error(key) is None


async def test_requeue_after_brings_the_key_back_after_that_long(
        clock: FakeClock, registry: CollectorRegistry,
        stop_after: list[Controller[Key]]) -> None:
    key = claim("polled")
    reconciler = ScriptedReconciler(clock, forever={key: Result(requeue_after=30.0)})
    controller = make(clock, registry, reconciler)
    controller.start()
    stop_after.append(controller)
    controller.queue.add(key)
    await settle()
    clock.advance(29.0)
    await settle()
    assert reconciler.times(key) == [0.0]
    for _ in range(2):
        await run_clock_to_next_wakeup(clock)
    assert reconciler.times(key) == [0.0, 30.0, 60.0]
    assert controller.queue.failures(key) == 0


# -- metrics ---------------------------------------------------------------------------------------

async def test_metrics_start_at_zero_and_count_every_result(
        clock: FakeClock, registry: CollectorRegistry,
        stop_after: list[Controller[Key]]) -> None:
    reconciler = ScriptedReconciler(clock, {
        claim("ok"): [Result()], claim("again"): [Result(requeue_after=60.0)],
        claim("bad"): [TerminalError("no")], claim("err"): [RuntimeError("x"), Result()]})
    controller = make(clock, registry, reconciler, workers=2)
    assert totals(registry) == {"success": 0, "error": 0, "requeue": 0, "terminal": 0}
    labels = {"controller": "claims"}
    assert registry.get_sample_value("active_workers", labels) == 0
    assert registry.get_sample_value("reconcile_time_seconds_count", labels) == 0
    for name in ("ok", "again", "bad", "err"):
        controller.queue.add(claim(name))
    assert registry.get_sample_value("workqueue_depth", labels) == 4
    controller.start()
    stop_after.append(controller)
    await settle()
    assert totals(registry) == {"success": 1, "error": 1, "requeue": 1, "terminal": 1}
    await run_clock_to_next_wakeup(clock)  # the error's retry, 5 ms later
    assert totals(registry) == {"success": 2, "error": 1, "requeue": 1, "terminal": 1}
    assert registry.get_sample_value("reconcile_time_seconds_count", labels) == 5
    assert registry.get_sample_value("active_workers", labels) == 0
    assert registry.get_sample_value("workqueue_depth", labels) == 0


async def test_active_workers_counts_reconciles_in_flight(
        clock: FakeClock, registry: CollectorRegistry,
        stop_after: list[Controller[Key]]) -> None:
    reconciler = ScriptedReconciler(clock)
    gate = asyncio.Event()
    for name in "ab":
        reconciler.gates[claim(name)] = gate
    controller = make(clock, registry, reconciler, workers=3)
    controller.start()
    stop_after.append(controller)
    controller.queue.add(claim("a"))
    controller.queue.add(claim("b"))
    await settle()
    assert registry.get_sample_value("active_workers", {"controller": "claims"}) == 2
    clock.advance(2.5)
    gate.set()
    await settle()
    assert registry.get_sample_value("active_workers", {"controller": "claims"}) == 0
    assert registry.get_sample_value("reconcile_time_seconds_sum", {"controller": "claims"}) == 5.0


def test_controllers_given_one_registry_share_its_families_with_their_own_series(
        clock: FakeClock, registry: CollectorRegistry) -> None:
    for name in ("claims", "pools"):
        Controller(name, ScriptedReconciler(clock), WorkQueue[Key](clock), clock=clock,
                   metrics=registry)
    assert registry.get_sample_value("reconcile_total",
                                     {"controller": "pools", "result": "error"}) == 0
    assert ControllerMetrics.shared(registry) is ControllerMetrics.shared(registry)


def test_a_controller_without_metrics_gets_a_private_registry(clock: FakeClock) -> None:
    controller = Controller("alone", ScriptedReconciler(clock), WorkQueue[Key](clock))
    assert controller.metrics.registry.get_sample_value(
        "reconcile_total", {"controller": "alone", "result": "success"}) == 0


# -- lifecycle -------------------------------------------------------------------------------------

async def test_stop_lets_the_reconcile_in_flight_finish_and_starts_no_other(
        clock: FakeClock, registry: CollectorRegistry) -> None:
    reconciler = ScriptedReconciler(clock)
    reconciler.gates[claim("a")] = asyncio.Event()
    controller = make(clock, registry, reconciler)
    controller.start()
    controller.queue.add(claim("a"))
    controller.queue.add(claim("b"))
    await settle()
    stopping = asyncio.create_task(controller.stop())
    await settle()
    assert not stopping.done()
    reconciler.gates[claim("a")].set()
    await asyncio.wait_for(stopping, 5)
    assert reconciler.finished == [claim("a")] and reconciler.cancelled == []
    assert not controller.running
    assert totals(registry)["success"] == 1


async def test_stop_with_a_grace_period_cancels_reconciles_that_overrun_it(
        clock: FakeClock, registry: CollectorRegistry) -> None:
    reconciler = ScriptedReconciler(clock)
    reconciler.gates[claim("stuck")] = asyncio.Event()
    controller = make(clock, registry, reconciler)
    controller.start()
    controller.queue.add(claim("stuck"))
    await settle()
    stopping = asyncio.create_task(controller.stop(grace=10.0))
    await settle()
    clock.advance(9.0)
    await settle()
    assert not stopping.done()
    clock.advance(1.0)
    await asyncio.wait_for(stopping, 5)
    assert reconciler.cancelled == [claim("stuck")]
    assert registry.get_sample_value("active_workers", {"controller": "claims"}) == 0


async def test_watched_sources_start_and_stop_with_the_controller(
        clock: FakeClock, registry: CollectorRegistry) -> None:
    reconciler = ScriptedReconciler(clock)
    names: Iterable[str] = ("a", "b")
    controller = make(clock, registry, reconciler, workers=2)
    controller.watch(TimerSource(clock, 300.0, lambda: [claim(n) for n in names]))
    controller.start()
    await settle()
    assert sorted(k for _, k in reconciler.calls) == [claim("a"), claim("b")]
    clock.advance(300.0)
    await settle()
    assert len(reconciler.calls) == 4
    await controller.stop()
    assert clock.sleepers == 0
    clock.advance(300.0)
    await settle()
    assert len(reconciler.calls) == 4


async def test_starting_twice_is_refused(clock: FakeClock, registry: CollectorRegistry) -> None:
    controller = make(clock, registry, ScriptedReconciler(clock))
    controller.start()
    with pytest.raises(RuntimeError):
        controller.start()
    await controller.stop()
