"""Engine phases and the transitions allowed between them.

Phases are an enum with one explicit table of allowed transitions. Only an engine's owner
changes its phase, through ``check_transition``, so an impossible move is a bug that shows up
at once instead of a bare string silently changed in place.
"""

from __future__ import annotations

import enum

# The seed's contract: restarts after 2, 4, 8, 16 and 32 seconds, five over an engine's life,
# then the engine is failed.
DEFAULT_RESTART_DELAYS: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0, 32.0)


class Phase(enum.StrEnum):
    ACTIVATING = "activating"  # record written, process not started yet
    BOOTING = "booting"  # process alive, not answering /health yet
    ACTIVE = "active"  # answers /health and is awake: serves requests
    SLEEPING = "sleeping"  # answers /health, asleep (weights offloaded)
    RESTARTING = "restarting"  # exited unexpectedly, waiting out its backoff delay
    FAILED = "failed"  # restart budget spent or cannot start at all; keeps last_error
    STOPPING = "stopping"  # deactivate in progress
    STOPPED = "stopped"  # gone for good; the record is removed


_ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.ACTIVATING: frozenset({Phase.BOOTING, Phase.RESTARTING, Phase.FAILED, Phase.STOPPING}),
    Phase.BOOTING: frozenset(
        {Phase.ACTIVE, Phase.SLEEPING, Phase.RESTARTING, Phase.FAILED, Phase.STOPPING}
    ),
    Phase.ACTIVE: frozenset({Phase.SLEEPING, Phase.RESTARTING, Phase.FAILED, Phase.STOPPING}),
    Phase.SLEEPING: frozenset({Phase.ACTIVE, Phase.RESTARTING, Phase.FAILED, Phase.STOPPING}),
    Phase.RESTARTING: frozenset({Phase.BOOTING, Phase.RESTARTING, Phase.FAILED, Phase.STOPPING}),
    # A failed engine stays failed until deactivated, or activated again with its spec.
    Phase.FAILED: frozenset({Phase.STOPPING, Phase.RESTARTING}),
    Phase.STOPPING: frozenset({Phase.STOPPED}),
    Phase.STOPPED: frozenset(),
}


class TransitionError(RuntimeError):
    """An owner tried a move the table forbids: a programming error, never user input."""


def allowed(src: Phase, dst: Phase) -> bool:
    return dst in _ALLOWED[src]


def check_transition(src: Phase, dst: Phase) -> None:
    if not allowed(src, dst):
        raise TransitionError(f"engine phase cannot move from {src.value} to {dst.value}")
