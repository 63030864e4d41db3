"""GPU memory truth for the agent: what each card and engine holds, and who may claim the rest.

* ``model``: the frozen values every backend returns (devices, processes, a sample).
* ``backend``: the ``GpuBackend`` protocol; ``nvml`` (real cards) and ``simulated`` (fed by
  simulated engines) implement it; ``pidmap`` places NVML's host PIDs in our PID namespace.
* ``proctree`` + ``attribution``: an engine's HBM, summed over its whole process tree.
* ``ledger`` (GPU) and ``host_ledger`` (host memory for level-1 sleeps): claims before spending.
* ``admission``: admit / refuse (TooLargeForAnyCard, InsufficientGPUMemory, InsufficientHostMemory).
* ``gate``: at most one start or wake per card at a time, FIFO.
"""
