"""The shared-fate attack (issue 21): a slowloris on the embedded door must not starve the agent.

In the embedded mode (``serve --claims DIR``) the door, the reconciler and the agent are one
process. With the agent's open-files soft limit at 4,096, more half-sent request heads than that
go to the door (``tests/slowloris.py``, another process) while the test, as an outside writer,
raises the engine's KV segment: the agent must set it back within its hold interval, answer
``/healthz`` in well under 100 ms, log no traceback, serve the door again once the attack ends,
and stop on SIGTERM with exit code 0 while another attack is under way. Before the door had a
connection cap and a head deadline, the attack took the descriptors the KV hold needs.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime_agent.kv.segment import read_segment, write_limit
from tests.harness import ROOT, AgentProcess, http_json, wait_until
from tests.test_door_integration import CARD, CHAT, claim

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
GiB = 1 << 30
SOFT_NOFILE = 4096
ATTACK = SOFT_NOFILE + 1024  # more half-sent heads than the agent has descriptors
HOLD_S = 0.2  # the harness's --kv-hold-interval
SLACK_S = 1.8  # a loaded 2-core machine
HEALTHZ_S = 0.1


@contextlib.contextmanager
def soft_nofile(limit: int) -> Iterator[None]:
    """This process's open-files soft limit lowered for as long as it starts a child (which
    inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def slowloris(port: int, count: int, seconds: float) -> Iterator[Callable[[], dict[str, int]]]:
    """``count`` half-sent heads held on ``port`` (once every one has been tried); yields what
    ends the attack and returns what the connections were answered."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.slowloris", str(port), str(count),
                             str(seconds)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    result: dict[str, int] = {}

    def stop() -> dict[str, int]:
        if not result and proc.poll() is None:
            proc.terminate()
        if not result:
            out, _ = proc.communicate(timeout=30)
            result.update(json.loads(out.strip().splitlines()[-1]) if out.strip() else {})
        return result

    try:
        line = proc.stdout.readline()
        assert line.startswith("opened"), line
        yield stop
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
            stop()
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)


def healthz_seconds(port: int) -> float:
    """One ``/healthz`` on a new connection (accepting one is what an fd shortage stops), in
    seconds; 2 s for one that fails. From 127.0.0.2: another client than the attacker, whose
    share of a server's connections is used up."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2,
                                      source_address=("127.0.0.2", 0))
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        resp.read()
        return time.monotonic() - started if resp.status == 200 else 2.0
    except OSError:
        return 2.0
    finally:
        conn.close()


def total_size(agent: AgentProcess, segment: str) -> int | None:
    info = read_segment(segment, agent.shm_dir)
    return info.total_size if info is not None else None


def set_back_seconds(agent: AgentProcess, segment: str, held: int) -> float:
    """Raise the segment from outside (as ``kvctl limit`` would), and how long until the agent
    had set it back (inf: not within 10 s)."""
    write_limit(segment, 6 * GiB, agent.shm_dir)
    started = time.monotonic()
    if not wait_until(lambda: total_size(agent, segment) == held, 10, interval=0.01):
        return float("inf")
    return time.monotonic() - started


def serving(agent: AgentProcess, name: str) -> Callable[[dict[str, Any]], bool]:
    def ok(snap: dict[str, Any]) -> bool:
        found = [m for m in snap["models"] if m["model_name"] == name]
        return bool(found) and found[0]["phase"] == "active" \
            and found[0]["kv_limit_applied_bytes"] is not None \
            and bool(found[0]["kv_segment"]["present"])
    return ok


@pytest.mark.parametrize("target", ["door", "agent API"])
def test_a_slowloris_does_not_starve_the_agent_of_the_descriptors_it_holds_kv_limits_with(
        target: str, tmp_path: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    (claims / "m.yaml").write_text(claim("m"))
    with soft_nofile(SOFT_NOFILE):  # ports the harness picks again if another process takes one
        agent = agent_factory(free_ports=["--claims-port", "--door-port"],
                              extra_args=[*CARD, "--claims", str(claims)])
    assert agent.proc is not None
    door = agent.ports["--door-port"]
    port = door if target == "door" else agent.port
    snap = agent.wait_for(serving(agent, "m"), 60, "m active with its KV limit", poll_s=0.2)
    model = agent.model(snap, "m")
    segment, held = model["kv_segment"]["name"], model["kv_limit_applied_bytes"]
    assert total_size(agent, segment) == held
    log_from = agent.log_path.stat().st_size

    with slowloris(port, ATTACK, 60) as stop:
        fds = len(os.listdir(f"/proc/{agent.proc.pid}/fd"))
        set_back = set_back_seconds(agent, segment, held)
        latencies = [healthz_seconds(agent.port) for _ in range(9)]
        answered = stop()
    assert set_back <= HOLD_S + SLACK_S, f"set back after {set_back:.2f} s ({fds} fds open)"
    assert statistics.median(latencies) < HEALTHZ_S, (latencies, fds)
    assert fds < SOFT_NOFILE * 3 // 4, fds
    assert answered.get("503", 0) >= ATTACK - SOFT_NOFILE, answered  # over the cap

    status, body = http_json(f"http://127.0.0.1:{door}/v1/chat/completions", "POST",
                             {"model": "m", "messages": CHAT, "max_tokens": 4})
    assert status == 200, body

    with slowloris(port, ATTACK, 60):  # SIGTERM under attack: a clean, prompt stop
        started = time.monotonic()
        assert agent.terminate() == 0
        assert time.monotonic() - started < 15
    log = agent.log_path.read_bytes()[log_from:].decode(errors="replace")
    assert "Traceback" not in log and "Cannot close a running event loop" not in log, log[-4000:]
