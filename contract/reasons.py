"""Reason names: the words in refusals, conditions and events that both sides act on.

The agent answers a refusal with a ``reason`` and the reconciler decides on it (retry, wait,
move, give up), so each name is defined here once. The first group is the seed's.
"""

from __future__ import annotations

# Admission (the seed's words): can this engine start or wake here at all, or only later?
TOO_LARGE = "TooLargeForAnyCard"  # never fits any card: refused at once, never retried
INSUFFICIENT_GPU = "InsufficientGPUMemory"  # fits an empty card, not now: wait or make room
INSUFFICIENT_HOST = "InsufficientHostMemory"  # a level-1 sleep needs host memory for weights
INVALID_ENGINE_CONFIG = "InvalidEngineConfig"  # the engine's arguments or artifact are wrong
INVALID_PER_GPU = "InvalidPerGPU"
NO_MATCHING_PODS = "NoMatchingPods"

# Engine conditions and events (the agent's).
KV_LIMIT_NOT_HELD = "KVLimitNotHeld"
KV_SEGMENT_MISSING = "KVSegmentMissing"  # the segment was deleted under the running engine
START_FAILED = "StartFailed"
RESTART_BUDGET_EXHAUSTED = "RestartBudgetExhausted"
ENGINE_UNRESPONSIVE = "EngineUnresponsive"
SLEEP_FAILED = "SleepFailed"
WAKE_FAILED = "WakeFailed"
STORAGE_UNAVAILABLE = "StorageUnavailable"
ENGINE_MISSING = "EngineExecutableMissing"
PORT_HELD = "PortHeld"
# a start waiting for its turn on its cards (runtime_agent/gpu/gate.py): a measured start is
# alone there, or one waits to be
START_QUEUED = "StartQueued"
# an activation that a concurrent deactivate stopped (409): the callers raced, nothing failed
STOPPED_MEANWHILE = "DeactivatedMeanwhile"

# Claim conditions and events (the reconciler's).
AGENT_NOT_READY = "AgentNotReady"
