"""The Kubernetes mode's parts that decide alone: the Event recorder's spam filter, aggregation
and deduplication (client-go's rules), the change rule shared by both modes, pool Pods read
as agents, and the route publisher stopping whenever a change comes with the stop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from contract.clock import LoopClock
from reconciler.kube.desired import KubeDesired, pod_agent
from reconciler.kube.events import COMBINED, EventRecorder, ObjectRef
from reconciler.kube.routes import RoutePublisher
from reconciler.model.changes import IMMUTABLE_FIELD_CHANGED, take_change
from reconciler.model.manifests import claim_from_object
from tests.clocks import FakeClock
from tests.reconciler_fakes import Rig

REF = ObjectRef("model.aibrix.ai/v1alpha1", "ModelClaim", "default", "c", "uid-1")


class Recording:
    """What an EventRecorder sends, recorded instead of sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    async def create(self, res: Any, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.sent.append(("create", body))
        return body

    async def patch(self, res: Any, namespace: str, name: str, body: Any,
                    content_type: str = "") -> dict[str, Any]:
        self.sent.append(("patch", body))
        return {}


async def drained(recorder: EventRecorder) -> None:
    await asyncio.wait_for(recorder._queue.join(), 5)


async def test_a_claim_gets_25_events_in_a_burst_then_one_every_five_minutes() -> None:
    api, clock = Recording(), FakeClock()
    recorder = EventRecorder(api, clock=clock)  # type: ignore[arg-type]
    recorder.start()
    for i in range(40):
        recorder.record(REF, "Normal", f"R{i}", "m")
    await drained(recorder)
    assert len(api.sent) == 25 and recorder.dropped == 15
    clock.advance(299)
    recorder.record(REF, "Normal", "Late", "m")
    clock.advance(1)
    recorder.record(REF, "Normal", "OnTime", "m")
    await drained(recorder)
    assert [b["reason"] for _, b in api.sent[25:]] == ["OnTime"]
    await recorder.stop()


async def test_a_repeated_event_is_counted_on_the_first_instead_of_sent_again() -> None:
    api = Recording()
    recorder = EventRecorder(api, clock=FakeClock())  # type: ignore[arg-type]
    recorder.start()
    for _ in range(3):
        recorder.record(REF, "Warning", "WakeFailed", "no room")
    await drained(recorder)
    kinds = [k for k, _ in api.sent]
    assert kinds == ["create", "patch", "patch"] and api.sent[-1][1]["count"] == 3
    await recorder.stop()


async def test_events_older_than_the_window_are_forgotten_and_repeats_keep_theirs() -> None:
    api, clock = Recording(), FakeClock()
    recorder = EventRecorder(api, clock=clock)  # type: ignore[arg-type]
    recorder.start()
    recorder.record(REF, "Normal", "A", "m")
    clock.advance(1)
    recorder.record(REF, "Normal", "B", "m")
    clock.advance(499)
    recorder.record(REF, "Normal", "A", "m")  # counted on the first: kept 10 minutes more
    clock.advance(150)
    recorder.record(REF, "Normal", "C", "m")  # B is older than the window now
    assert [k[2] for k in recorder._sent] == ["A", "C"]
    recorder.record(REF, "Normal", "A", "m")
    recorder.record(REF, "Normal", "B", "m")
    await drained(recorder)
    assert [(k, b.get("reason", b.get("count"))) for k, b in api.sent] == [
        ("create", "A"), ("create", "B"), ("patch", 2), ("create", "C"), ("patch", 3),
        ("create", "B")]
    await recorder.stop()


async def test_many_similar_events_are_combined_into_one() -> None:
    api = Recording()
    recorder = EventRecorder(api, clock=FakeClock())  # type: ignore[arg-type]
    recorder.start()
    for i in range(14):
        recorder.record(REF, "Normal", "KVLimitSet", f"KV limit {i} GiB")
    await drained(recorder)
    creates = [b for k, b in api.sent if k == "create"]
    assert len(creates) == 11 and creates[-1]["message"].startswith(COMBINED)
    assert [k for k, _ in api.sent[11:]] == ["patch"] * 3
    await recorder.stop()


def claim(**spec: Any) -> Any:
    doc = {"apiVersion": "model.aibrix.ai/v1alpha1", "kind": "ModelClaim",
           "metadata": {"name": "c"},
           "spec": {"podSelector": {"matchLabels": {"p": "a"}}, "artifactURL": "hf://x/y",
                    "perGPU": {"maximumFootprint": "6Gi", "kvFloor": "1Gi"}, **spec}}
    return claim_from_object(doc)


def test_only_a_per_gpu_change_takes_effect() -> None:
    running = claim()
    taken = take_change(running, claim(perGPU={"maximumFootprint": "5Gi", "kvFloor": "1Gi"}))
    assert taken.problem is None and taken.claim.per_gpu is not None
    assert taken.claim.per_gpu.maximum_footprint == 5 << 30
    both = take_change(running, claim(engine="sglang",
                                      perGPU={"maximumFootprint": "4Gi", "kvFloor": "1Gi"}))
    assert both.problem is not None and both.problem.reason == IMMUTABLE_FIELD_CHANGED
    assert "spec.engine" in both.problem.message and both.claim.engine == "vllm"
    assert both.claim.per_gpu is not None and both.claim.per_gpu.maximum_footprint == 4 << 30


def pod(phase: str = "Running", ip: str | None = "10.0.0.5", deleting: bool = False,
        port: int | None = 8090) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": "ns", "labels": {"a": "b"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    ports = [{"name": "runtime", "containerPort": port}] if port else []
    return {"metadata": meta, "spec": {"containers": [{"ports": ports}]},
            "status": {"phase": phase, **({"podIP": ip} if ip else {})}}


def test_a_pool_pod_is_an_agent_only_while_it_runs_with_an_ip() -> None:
    assert pod_agent(pod(), "pool-a").url == "http://10.0.0.5:8090"
    assert pod_agent(pod(port=None), "pool-a").url == "http://10.0.0.5:8080"
    assert pod_agent(pod(ip="fd00::5"), "pool-a").url == "http://[fd00::5]:8090"
    for stopped in (pod(phase="Pending"), pod(ip=None), pod(phase="Succeeded")):
        assert pod_agent(stopped, "pool-a").url is None
    deleting = pod_agent(pod(deleting=True), "pool-a")  # its grace period: it drains
    assert deleting.url == "http://10.0.0.5:8090"
    assert deleting.labels == {"a": "b", "claim.model.aibrix.ai/draining": "true"}
    assert pod_agent(pod(), "pool-a").labels == {"a": "b"}


async def test_the_route_publisher_stops_when_a_change_comes_with_the_stop(
        tmp_path: Path) -> None:
    """A replica stopping marks claims up to its last moment (its last reconciles, the watch);
    a mark in the same loop turn as the stop once made the publisher's wait swallow the cancel
    (``asyncio.wait_for`` on 3.11), so the replica never stopped. Every turn up to a few later."""
    rig = Rig(tmp_path, [])
    for turns in range(4):
        publisher = RoutePublisher(None, KubeDesired(), rig.deps,  # type: ignore[arg-type]
                                   LoopClock())
        publisher.start()
        await asyncio.sleep(0.01)  # waiting for a mark
        publisher.mark(("default", "gone"))  # nothing to publish: no API call
        for _ in range(turns):
            await asyncio.sleep(0)
        stopping = asyncio.ensure_future(publisher.stop())
        done, _ = await asyncio.wait({stopping}, timeout=2)
        assert done, f"the publisher did not stop ({turns} turns after a mark)"
