"""How long the simulated engine takes to start, fall asleep and wake, by the model's size.

A simulator that starts in a blink and wakes in 17 ms hides what the agent is for (holding a
request while its model wakes). So, unless a ``--sim-*-seconds`` flag (or its ``SIM_*``
environment fallback) says otherwise, the times grow with the model's declared size: the bytes of
its weights, ``--sim-memory-bytes`` (``SIM_MEMORY_BYTES``, default 1 GiB, about a 0.5B model in
bf16). That is the figure the simulator already reports as its weights' GPU memory, so its memory
and its timings describe one model; a real vLLM learns its size the same way, from its weights,
not from the claim (a claim's ``perGPU.maximumFootprint`` is an admission budget, KV and
activations included, and the engine never sees it).

Figures, and where they come from:

* Weights load from the page cache at about 1.5 GB/s: vLLM's "Loading weights took ..." lines for
  safetensors checkpoints are typically 1-2 GB/s on one GPU (a 16 GB 8B model in 8-16 s).
* Level-1 sleep keeps the weights in pinned host memory and a wake copies them back at host-to-device
  bandwidth: the vLLM blog "Zero-Reload Model Switching with vLLM Sleep Mode"
  (blog.vllm.ai/2025/10/26/sleep-mode.html) measures level-1 wakes of 0.1 s (Qwen3-0.6B) to
  about 6 s (the largest models, per GPU), i.e. a fixed ~0.1 s plus ~12 GB/s effective. Falling
  asleep at level 1 is the same copy the other way.
* Level 2 discards the weights: a wake maps empty memory (the fixed part only) and
  ``collective_rpc reload_weights`` reads them from disk (page cache) at the load rate. The blog's
  level-2 wakes, reload included, are 0.8-2.6 s. A level-2 sleep only frees memory.
* A cold start is much more than the weights: process start, CUDA context, torch.compile and CUDA
  graph capture cost a real vLLM 20-60 s (the blog's "30-100+ seconds per switch"). The simulator
  compresses that fixed part to START_FIXED_S, so a demo that starts, kills and restarts engines
  stays under a minute; the weights' part is kept.

Every time is capped (START_CAP_S, WAKE_CAP_S) so a huge declared model cannot stall a demo or a
test for minutes. Tests that want speed pass ``--sim-startup-seconds 0`` and friends, or set the
``SIM_*`` variables (tests/conftest.py does, for every process the suite starts).
"""

from __future__ import annotations

LOAD_BYTES_PER_S = 1.5e9  # weights from the page cache into GPU memory (cold start, level-2 wake)
H2D_BYTES_PER_S = 12e9  # pinned host memory to the GPU and back (level-1 wake and sleep)
WAKE_FIXED_S = 0.1  # remapping the allocator's pools, re-enabling the scheduler
START_FIXED_S = 2.0  # a real vLLM's 20-60 s of initialisation, compressed
START_CAP_S = 30.0
WAKE_CAP_S = 10.0


def start_seconds(weights_bytes: int) -> float:
    """A cold start of a model with ``weights_bytes`` of weights: initialisation, then the load."""
    return min(START_CAP_S, START_FIXED_S + max(0, weights_bytes) / LOAD_BYTES_PER_S)


def wake_seconds(weights_bytes: int, level: int, weights: bool = True) -> float:
    """A wake from sleep ``level``: memory mapped again and, after a level-1 sleep, the weights
    copied back from host memory (``weights``: the wake includes the weights tag)."""
    copy = max(0, weights_bytes) / H2D_BYTES_PER_S if level <= 1 and weights else 0.0
    return min(WAKE_CAP_S, WAKE_FIXED_S + copy)


def reload_seconds(weights_bytes: int) -> float:
    """vLLM's ``reload_weights`` after a level-2 sleep: the weights read from disk again."""
    return min(WAKE_CAP_S, max(0, weights_bytes) / LOAD_BYTES_PER_S)


def sleep_seconds(weights_bytes: int, level: int) -> float:
    """Falling asleep at ``level``: level 1 copies the weights to host memory; level 2 frees them."""
    if level >= 2:
        return WAKE_FIXED_S
    return min(WAKE_CAP_S, WAKE_FIXED_S + max(0, weights_bytes) / H2D_BYTES_PER_S)
