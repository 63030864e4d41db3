"""Re-adoption: what a starting agent does with the engines a previous agent left behind.

Inputs are the registry (records, some possibly quarantined as corrupt) and a scan of running
processes that carry this state directory in their environment. Each record becomes one of:
- adopt: its PID is alive and is provably the same process (PID + start time + engine id);
- adopt a found process: the record has no PID, but a process carrying the record's engine
  id leads its own group (the agent died between starting it and writing its PID);
- restart: the recorded process runs no more (counted against the restart budget). A helper
  that left the engine's group and outlived its leader carries the engine's id and leads a
  session of its own, but it is not the engine: its port answers nothing. It is killed with
  the other leftovers and the engine restarted, never adopted in the leader's place;
- idle: the engine had failed for good; it keeps its record and last_error;
- finish a stop: the agent died while stopping it, or stopped it while its record could not
  be changed (a read-only state directory: ``registry.stops`` remembers it).
A running engine whose record was lost or corrupted is rebuilt from the spec it carries in its
environment, so no running engine is lost with its file. ``plan`` is pure; ``recover`` does
the I/O in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from msgspec import Struct

from contract.phases import Phase
from registry import stops
from registry.identity import FoundEngine, Verdict, scan_engines, verify
from registry.env import ENV_ENGINE_ID, ENV_ENGINE_SPEC
from registry.store import LoadResult, RegistryStore
from runtime_agent.supervision.messages import StartMode

if TYPE_CHECKING:
    from registry.record import EngineRecord

log = logging.getLogger(__name__)


class Step(Struct, frozen=True):
    record: EngineRecord
    mode: StartMode
    pid: int | None
    note: str
    rebuilt: bool = False  # the record was rebuilt from the process environment


def record_from_process(found: FoundEngine, now: float) -> EngineRecord | None:
    """Rebuild a record from what an engine carries in its environment: its spec, port, cards,
    declared need, KV limit and sleep state at its start, and its credentials by name."""
    from registry.record import EngineRecord  # loaded with the first engine

    try:
        carried = json.loads(found.environ.get(ENV_ENGINE_SPEC, ""))
        keys = carried.get("credential_keys") or []
        return msgspec.convert({  # validated as a record read from disk is
            "engine_id": found.environ[ENV_ENGINE_ID], "spec": carried["spec"],
            "port": int(carried["port"]), "pid": found.pid, "pid_start_time": found.start_time,
            "phase": Phase.BOOTING.value, "created_at": now, "last_transition": now,
            "devices": carried.get("devices") or [], "per_gpu": carried.get("per_gpu"),
            "kv_limit_bytes": carried.get("kv_limit_bytes"),
            "desired": carried.get("desired") or "awake",
            "sleep_level": carried.get("sleep_level"),
            "credentials": {k: found.environ[k] for k in keys if k in found.environ}},
            EngineRecord)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError,
            msgspec.ValidationError):  # RecursionError: json's and msgspec's nesting bound
        return None


def plan(records: list[EngineRecord], found: list[FoundEngine],
         check: Callable[[int, int, str], Verdict], now: float,
         stopped: frozenset[str] = frozenset()) -> list[Step]:
    """What to do with each record and each engine process found (pure). Only a process that
    leads its own group is an engine: a worker whose leader died is a leftover (``leftovers``).
    ``stopped``: engine ids whose stop was remembered outside the registry (``registry.stops``)."""
    by_id: dict[str, FoundEngine] = {}
    for f in sorted(found, key=lambda f: f.start_time):  # the first started of one id leads
        if f.leads_its_group:
            by_id.setdefault(f.environ[ENV_ENGINE_ID], f)
    steps: list[Step] = []
    names: set[str] = set()
    for record in records:
        if record.spec.model_name in names:
            continue  # two records for one name cannot both be ours; the first wins
        names.add(record.spec.model_name)
        proc = by_id.pop(record.engine_id, None)
        verdict = Verdict.GONE
        if record.pid is not None and record.pid_start_time is not None:
            verdict = check(record.pid, record.pid_start_time, record.engine_id)
        if verdict is not Verdict.MATCH and proc is not None and record.pid in (None, proc.pid):
            # Only a record without a PID, or the recorded PID itself (carrying the id: a
            # start time misrecorded), may take a found process as its engine: a record's PID
            # names its leader, and another process carrying its id is a helper that outlived
            # it (a daemon in its own session); it is no engine alone.
            record.pid, record.pid_start_time = proc.pid, proc.start_time
            verdict = Verdict.MATCH
        phase = record.phase
        if phase is Phase.STOPPING or record.engine_id in stopped:
            steps.append(Step(record, StartMode.STOP, record.pid if verdict is Verdict.MATCH else None,
                              "finishing a stop the previous agent began"))
        elif phase is Phase.FAILED:
            steps.append(Step(record, StartMode.IDLE, None, "failed before the agent restarted"))
        elif verdict is Verdict.MATCH:
            steps.append(Step(record, StartMode.ADOPT, record.pid, f"pid {record.pid} verified"))
        else:
            steps.append(Step(record, StartMode.RESTART, None, f"process {verdict.value}"))
    for proc in list(by_id.values()):
        rebuilt = record_from_process(proc, now)
        if rebuilt is None or rebuilt.spec.model_name in names:
            log.warning("engine process %d carries no usable spec; left alone", proc.pid)
            continue
        names.add(rebuilt.spec.model_name)
        steps.append(Step(rebuilt, StartMode.ADOPT, proc.pid, "rebuilt from the process environment",
                          rebuilt=True))
    return steps


def leftovers(steps: list[Step], found: list[FoundEngine]) -> list[FoundEngine]:
    """Processes that carry an engine id but belong to no engine taken over as running: the
    workers of a leader that died while no agent watched (they hold GPU memory and ports)."""
    live = {step.record.engine_id for step in steps
            if step.mode is StartMode.ADOPT and step.pid is not None}
    return [f for f in found if f.environ[ENV_ENGINE_ID] not in live]


def _gather(store: RegistryStore, state_dir: str, stops_dir: Path | None
            ) -> tuple[LoadResult, list[FoundEngine], list[Step]]:
    loaded = store.load_all()
    found = scan_engines(state_dir, every=True)
    stopped = frozenset(r.engine_id for r in loaded.records
                        if stops_dir is not None and stops.marked(stops_dir, state_dir, r.engine_id))
    steps = plan(loaded.records, found, verify, time.time(), stopped)
    for orphan in leftovers(steps, found):  # a dead leader's workers: end them before restarts
        log.warning("killing pid %d: it carries engine %s, whose leader is gone", orphan.pid,
                    orphan.environ[ENV_ENGINE_ID])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(orphan.pid, signal.SIGKILL)
    for step in steps:
        if step.rebuilt:
            store.save(step.record)
    return loaded, found, steps


async def recover(store: RegistryStore, state_dir: str, stops_dir: Path | None = None
                  ) -> tuple[LoadResult, list[Step]]:
    """``stops_dir``: where stops the registry could not record are remembered."""
    loaded, _, steps = await asyncio.to_thread(_gather, store, state_dir,  # /proc + disk reads
                                               stops_dir)
    for q in loaded.quarantined:
        log.warning("registry file %s was unreadable (%s); kept at %s", q.original, q.reason,
                    q.kept_at)
    return loaded, steps
