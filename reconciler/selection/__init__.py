"""Choosing, per call, which claim serves a request to a ``ModelRoute`` (issue 24), as pure
functions over frozen data: the route's spec (``route_spec``), its scores (``scoring``), its
ordered candidates (``candidates``), the seed's delay formulas (``delay``), victims and the
reservation book (``victims``, ``reservations``), refusals (``refusals``) and the per-call
choice that puts them together (``choice``); and the one rule, for both run modes, that takes a
route or refuses it (``route_manifests``). Nothing here does I/O or reads a clock: the door
and the reconciler build the view, call ``choice.choose`` and carry out the value it returns.
"""
