"""The contract shared by the agent and the reconciler: engine kinds and their argument rules,
the name rules, phases, reason names and quantities.

It imports nothing from ``runtime_agent``, ``reconciler``, ``engines`` or ``registry``, so both
sides can depend on it and one function answers each question for both.
"""
