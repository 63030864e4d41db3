"""Agent SIGKILLs during activations spend no engine's restart budget (issue 22).

Each cycle asks for two new models (not waiting for the answers), SIGKILLs the agent 0-0.3 s
later (the activations are accepted, starting or booting) and starts a new agent on the same
state directory and port block. Then every engine must be active with ``restart_count: 0``: none
of them ever crashed. On ``main`` before the fix, 20 cycles left 11 of 41 models ``failed`` with
"restart budget of 5 spent". The test suite runs 10 cycles
(tests/test_fields_by_phase.py); this runs the issue's 20.

    python -m bench.bench_agent_kills [--cycles 20]
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
import time

from bench.common import Result, count_main, log, session
from runtime_agent.client import AgentError
from tests.harness import AgentProcess


def _activate_soon(agent: AgentProcess, name: str) -> None:
    def call() -> None:
        with contextlib.suppress(OSError, AgentError):
            agent.activate_sim(name, "--sim-startup-seconds=0.3")

    threading.Thread(target=call, daemon=True).start()


def run(cycles: int = 20) -> Result:
    rng = random.Random(22)
    with session("agent-kills") as s:
        agent = s.agent(ports=200)
        for cycle in range(cycles):
            for k in range(2):
                _activate_soon(agent, f"m{cycle}-{k}")
            time.sleep(rng.uniform(0.0, 0.3))
            agent.kill()
            agent = s.agent(agent.state_dir, same_ports_as=agent, ports=200)
        log(f"agent-kills: {cycles} agents SIGKILLed; waiting for every engine to settle")
        snap = agent.wait_for(lambda sn: all(m["phase"] in ("active", "failed")
                                             for m in sn["models"]),
                              timeout_s=120, what="every engine settled", poll_s=0.2)
    models = snap["models"]
    spent = {m["model_name"]: (m["phase"], m["restart_count"]) for m in models
             if m["restart_count"] or m["phase"] != "active"}
    return Result(
        figure=f"agent SIGKILLs during activations ({cycles} cycles)",
        goal="every engine active with restart_count 0",
        measured=f"{len(models)} engines, {len(spent)} restarted or failed",
        passed=not spent and len(models) >= cycles,
        details={"engines": len(models), "spent": spent},
        lines=[f"{len(models)} of {2 * cycles} activations were accepted before their agent died",
               f"restarted or failed: {spent or 'none'}"],
    )


def main() -> int:
    return count_main(run, __doc__, "--cycles", 20)


if __name__ == "__main__":
    sys.exit(main())
