"""The one interface the agent uses to look at GPUs, so NVML and the simulation are interchangeable.

The agent holds exactly one backend for its whole life (NVML is initialised once), calls
``sample()`` from a worker thread (it blocks on the driver), and ``close()`` on shutdown.
"""

from __future__ import annotations

from typing import Protocol

from runtime_agent.gpu.model import GpuSample


class GpuUnavailable(RuntimeError):
    """No usable GPU here (no NVML library, no driver, no device): fall back to simulation."""


class GpuBackend(Protocol):
    name: str

    def sample(self) -> GpuSample:
        """Devices and their processes right now. Blocking; never raises for a driver error (the
        sample carries ``error`` instead), so a flaky driver cannot crash the agent's loop."""
        ...

    def close(self) -> None:
        """Release the backend (NVML shutdown). Safe to call twice."""
        ...
