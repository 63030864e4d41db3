"""Pure planners: placement, KV-cache division, idle sleep and victim choice.

Every function here is pure over frozen values (``state``): no I/O, no clock (time comes in as
``now``), the same answer for the same input. The controller turns runtime snapshots and claims
into ``Candidate``/``Gpu``/``Resident`` values, asks these planners, and acts on the answers.
``room_index`` is the one stateful piece: a plain data structure over those frozen values (the
candidates filed by free room per card), with no I/O or clock either.
"""
