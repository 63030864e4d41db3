"""The engine owner: one loop per engine (``loop.EngineOwner``) and the parts it is made of.

Each part keeps its own fields and reaches the loop through one narrow protocol
(``port.OwnerLoop``); no module here imports another in a cycle, and no module outside this
package reads an owner's private attribute (``.importlinter``, ``tests/test_layers.py``).
"""

from runtime_agent.supervision.owner.deps import OwnerDeps
from runtime_agent.supervision.owner.loop import EngineOwner

__all__ = ["EngineOwner", "OwnerDeps"]
