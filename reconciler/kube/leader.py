"""Leader election on a ``coordination.k8s.io/v1`` Lease, after client-go's leaderelection.

Every replica runs an ``Elector``. A replica acquires the Lease when it does not exist, when it
holds it already, or when the holder has not renewed it for ``lease_duration`` as this replica
saw it (the time is this replica's own: the record's ``renewTime`` is compared only for change,
never against our clock, so clock skew between nodes cannot elect two leaders). Writes are
``PUT`` with the ``resourceVersion`` read, so two replicas racing for an expired Lease cannot
both win (one gets 409). The leader renews every ``retry_period``; if it cannot renew for
``renew_deadline`` it stops leading (``on_stopped``) before the Lease can expire for the others
(renew_deadline < lease_duration). On shutdown the leader releases the Lease (no holder, a
1-second duration), so a standby takes over within a retry period rather than a lease duration.

Defaults are client-go's: 15 s lease, 10 s renew deadline, 2 s retry period.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from contract.clock import Clock, LoopClock
from reconciler.kube.api import LEASES, Conflict, KubeApi, KubeError, NotFound

log = logging.getLogger("reconciler.kube.leader")


@dataclass(frozen=True)
class ElectionSettings:
    namespace: str
    name: str = "modelclaim-controller"
    identity: str = ""
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("need retry_period < renew_deadline < lease_duration")


def micro_time(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    def __init__(self, api: KubeApi, settings: ElectionSettings, *,
                 on_started: Callable[[], Awaitable[None]],
                 on_stopped: Callable[[], Awaitable[None]],
                 clock: Clock | None = None) -> None:
        self.api = api
        self.s = settings
        self.on_started = on_started
        self.on_stopped = on_stopped
        self.clock: Clock = clock or LoopClock()
        self.leading = False
        self._observed: tuple[Any, float] | None = None  # (record, clock time it changed)
        self._version = ""
        self.transitions = 0

    async def run(self) -> None:
        """Campaign until leading, lead until renewal fails; returns when leadership is lost
        (callers exit: a new leader must start from a clean slate)."""
        while not await self._try():
            await self.clock.sleep(self.s.retry_period)
        self.leading = True
        log.info("%s: leading (lease %s/%s)", self.s.identity, self.s.namespace, self.s.name)
        await self.on_started()
        last_renew = self.clock.now()
        while True:
            await self.clock.sleep(self.s.retry_period)
            if await self._try():
                last_renew = self.clock.now()
            elif self.clock.now() - last_renew >= self.s.renew_deadline:
                log.error("%s: could not renew the lease for %.0f s; no longer leading",
                          self.s.identity, self.s.renew_deadline)
                self.leading = False
                await self.on_stopped()
                return

    async def release(self) -> None:
        """Give the Lease up at once (shutdown of the leader)."""
        if not self.leading:
            return
        self.leading = False
        try:
            lease = await self.api.get(LEASES, self.s.namespace, self.s.name)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.s.identity:
                return
            now = micro_time(self.clock.wall())
            lease["spec"] = {**spec, "holderIdentity": None, "leaseDurationSeconds": 1,
                             "renewTime": now, "acquireTime": now}
            await self.api.replace(LEASES, self.s.namespace, self.s.name, lease)
            log.info("%s: released the lease", self.s.identity)
        except (KubeError, OSError) as err:
            log.warning("%s: releasing the lease failed: %s", self.s.identity, err)

    async def _try(self) -> bool:
        """One attempt to acquire or renew: True when we hold the Lease now."""
        now_wall, now = self.clock.wall(), self.clock.now()
        duration = int(self.s.lease_duration)
        try:
            lease = await self.api.get(LEASES, self.s.namespace, self.s.name)
        except NotFound:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.s.name, "namespace": self.s.namespace},
                    "spec": {"holderIdentity": self.s.identity,
                             "leaseDurationSeconds": duration,
                             "acquireTime": micro_time(now_wall),
                             "renewTime": micro_time(now_wall), "leaseTransitions": 0}}
            try:
                await self.api.create(LEASES, self.s.namespace, body)
                return True
            except (KubeError, OSError) as err:
                log.info("%s: creating the lease failed: %s", self.s.identity, err)
                return False
        except (KubeError, OSError) as err:
            log.warning("%s: reading the lease failed: %s", self.s.identity, err)
            return False
        spec = dict(lease.get("spec") or {})
        record = (spec.get("holderIdentity"), spec.get("renewTime"),
                  spec.get("leaseDurationSeconds"))
        if self._observed is None or self._observed[0] != record:
            self._observed = (record, now)
        holder = spec.get("holderIdentity")
        ours = holder == self.s.identity
        held_for = float(spec.get("leaseDurationSeconds") or duration)
        if holder and not ours and now - self._observed[1] < held_for:
            return False  # another replica holds it and renewed it lately
        if not ours:
            spec["acquireTime"] = micro_time(now_wall)
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        spec.update(holderIdentity=self.s.identity, leaseDurationSeconds=duration,
                    renewTime=micro_time(now_wall))
        lease["spec"] = spec
        try:
            await self.api.replace(LEASES, self.s.namespace, self.s.name, lease)
        except Conflict:
            return False
        except (KubeError, OSError) as err:
            log.warning("%s: %s the lease failed: %s", self.s.identity,
                        "renewing" if ours else "acquiring", err)
            return False
        if not ours:
            self.transitions += 1
            log.info("%s: acquired the lease from %s", self.s.identity, holder or "nobody")
        return True
