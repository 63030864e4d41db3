"""What an engine owner is given: its collaborators and its clock, so a test can give fakes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from msgspec import Struct, field

from contract.clock import Clock, LoopClock
from engines.driver import EngineDriver
from engines.process import ProcessLauncher
from registry.store import RegistryStore
from runtime_agent.gpu.broker import MemoryBroker
from runtime_agent.loops import Throttled
from runtime_agent.settings import Settings
from runtime_agent.supervision.durability import StorageHealth
from runtime_agent.supervision.ports import port_is_free
from runtime_agent.supervision.views import EngineEvent, EngineView

if TYPE_CHECKING:
    from registry.record import EngineRecord
    from runtime_agent.artifacts.staging import EngineStager

log = logging.getLogger("runtime_agent.supervision.owner")


class OwnerDeps(Struct, frozen=True):
    settings: Settings
    store: RegistryStore
    launcher: ProcessLauncher
    driver_for: Callable[[EngineRecord], EngineDriver]
    on_event: Callable[[EngineEvent], None]
    on_view: Callable[[EngineView], None]
    memory: MemoryBroker
    clock: Clock = field(default_factory=LoopClock)  # every time an owner reads or waits for
    port_free: Callable[[int, str], bool] = port_is_free
    stager: EngineStager | None = None  # the weight cache (None: off); see ``weights.py``
    storage: StorageHealth = field(default_factory=StorageHealth)  # shared by every owner
    throttled: Throttled = field(default_factory=lambda: Throttled(log))
