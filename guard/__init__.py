"""The guard: what every server and every input from outside goes through, written once.

Agent API, probe port, reconciler API and front door share it, so a rule (who may call what,
which paths and shared-memory names an input may name, how many connections and how long a
request head may take) has one implementation and one set of hostile-input tests. It sits on
``contract`` and imports neither the agent nor the reconciler (``.importlinter``).
"""
