"""Pure planners: placement, KV-cache division, idle sleep and victim choice.

Every function here is pure over frozen values (``state``): no I/O, no clock (time comes in as
``now``), the same answer for the same input. The controller turns runtime snapshots and claims
into ``Candidate``/``Gpu``/``Resident`` values, asks these planners, and acts on the answers.
"""
