"""The one way an owner's parts reach its loop: a narrow protocol, never the loop's own fields.

The loop (``EngineOwner``) is the only writer of the engine's phase, view and inbox. A part
(the intents, LoRA, the health answers, the record writer, staging) holds its own state and is
handed this protocol: it may tell an event (``emit``), write the record (``persist``), move the
phase (``transition``), show readers a change (``publish``), post a message to the inbox
(``post``), run or end helper tasks (``helper``, ``cancel_helpers``) and read or schedule
time (``clock``). It reads the engine's name, phase and process generation, and the record,
whose fields other than the phase a part may set before it asks for a write.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from msgspec import Struct

from contract.clock import Clock, Timer
from contract.phases import Phase
from runtime_agent.supervision.messages import Message

if TYPE_CHECKING:
    from registry.record import EngineRecord


class OwnerLoop(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def record(self) -> EngineRecord: ...

    @property
    def phase(self) -> Phase: ...

    @property
    def generation(self) -> int:
        """The current process's generation: news a helper posts is stamped with it."""
        ...

    @property
    def clock(self) -> Clock: ...

    def emit(self, reason: str, message: str, src: Phase | None = None,
             to: Phase | None = None, duration_s: float | None = None) -> None: ...

    async def persist(self) -> bool: ...

    async def transition(self, to: Phase, reason: str, message: str, persist: bool = True,
                         duration_s: float | None = None) -> None: ...

    def publish(self) -> None: ...

    def post(self, message: Message) -> None: ...

    def helper(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a helper of the current process (cancelled with it)."""
        ...

    def cancel_helpers(self) -> None:
        """The process is gone or going: its helpers end."""
        ...


def post_later(loop: OwnerLoop, delay_s: float, message: Message) -> Timer:
    """Post ``message`` to the loop's inbox once ``delay_s`` have passed on its clock."""
    return loop.clock.later(delay_s, Posted(message, loop.post))


class Posted(Struct, frozen=True):
    """A timer's callback that posts ``message`` to an owner's inbox: what a fake clock shows
    a test when it lists what an owner scheduled."""

    message: Message
    post: Callable[[Message], None]

    def __call__(self) -> None:
        self.post(self.message)
