"""The two slots of an engine owner whose fields go together: its process and its operation.

``ProcessSlot``: the engine's process, its generation (bumped with every process, so news from
a process that is gone is dropped) and why the agent itself killed it, if it did. ``OperationSlot``:
the sleep, wake or LoRA call in flight and the requests deferred behind it. Each rule that ties
these fields together is written once here: an operation starts, finishes, or is failed with
everyone waiting on it; the deferred requests drain one at a time once nothing is in flight.
"""

from __future__ import annotations

import asyncio
import signal
from collections import deque

from engines.process import EngineProcess
from runtime_agent.supervision.messages import Request


class ProcessSlot:
    def __init__(self) -> None:
        self._proc: EngineProcess | None = None
        self._gen = 0
        self._exit_cause: str | None = None

    @property
    def proc(self) -> EngineProcess | None:
        return self._proc

    @property
    def generation(self) -> int:
        return self._gen

    def current(self, gen: int) -> bool:
        """Whether news stamped ``gen`` is about the process of now."""
        return gen == self._gen

    def attach(self, proc: EngineProcess) -> int:
        """``proc`` is the engine's process now; returns its generation."""
        self._gen += 1
        self._proc = proc
        return self._gen

    def keep(self, proc: EngineProcess) -> None:
        """A process found while stopping: held so that the stop ends it (no new generation)."""
        self._proc = proc

    def release(self) -> EngineProcess | None:
        """The agent ends the process: news from it is void from now on."""
        proc, self._proc = self._proc, None
        self._gen += 1
        return proc

    def lost(self) -> None:
        """The process ended on its own: results its helpers queued already are void."""
        self._gen += 1
        self._proc = None

    def cause(self, exited: str) -> str:
        """What ended the process, told once: the agent's reason first, when it killed it."""
        if self._exit_cause is None:
            return exited
        cause, self._exit_cause = f"{self._exit_cause} (then {exited})", None
        return cause

    def kill(self, why: str) -> None:
        """End the whole process group (SIGKILL ends a stopped process too); its exit says why."""
        self._exit_cause = why
        if self._proc is not None:
            self._proc.signal_group(signal.SIGKILL)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.close()


class OperationSlot:
    def __init__(self) -> None:
        self._op: tuple[asyncio.Task[None], str, Request | None] | None = None
        self._deferred: deque[Request] = deque()

    @property
    def busy(self) -> bool:
        return self._op is not None

    @property
    def action(self) -> str | None:
        """The operation in flight (``sleep``, ``wake``, ``load_adapter``...), or None."""
        return self._op[1] if self._op is not None else None

    def start(self, task: asyncio.Task[None], action: str, request: Request | None) -> None:
        assert self._op is None, "one operation at a time"
        self._op = (task, action, request)

    def defer(self, request: Request) -> None:
        self._deferred.append(request)

    def finish(self) -> None:
        """The operation in flight ended (its result is being handled)."""
        self._op = None

    def fail_all(self) -> list[Request]:
        """Cancel the operation in flight; the requests that waited on it, first its own."""
        waiting = list(self._deferred)
        self._deferred.clear()
        if self._op is not None:
            task, _, request = self._op
            task.cancel()
            self.finish()
            if request is not None:
                waiting.insert(0, request)
        return waiting

    def next_deferred(self) -> Request | None:
        """The next deferred request, once nothing is in flight."""
        if self._op is None and self._deferred:
            return self._deferred.popleft()
        return None
