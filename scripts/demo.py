"""Demo: the agent on its embedded default, driven by the seed's two sample ModelClaims.

Starts ``runtime-agent serve --claims DIR`` (simulated GPU and engines when no GPU is present;
the embedded reconciler treats this agent as the pool) with a throw-away state directory and the
seed's `modelclaims.yaml` plus a pool that lets idle models sleep after a few seconds. It shows
the claims reaching Active, the agent's snapshot, a chat request served through the front door
(the one OpenAI-compatible port), an idle model put to sleep, a request that wakes it, an engine
killed and restarted on its port, and finally the claims deleted (the reconciler stops their
engines). Everything it started is
stopped at the end, unless --keep-running is given, and its temporary directory is removed
(unless --keep-dir is given).
A failure ends the demo with the agent's own one-line reason (a port in use, say), not a
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reconciler.cli import table as claims_table  # noqa: E402
from runtime_agent.console.tables import snapshot_table  # noqa: E402
from runtime_agent.client import AgentClient, AgentError  # noqa: E402

SLEEP_AFTER_S = 6
POOL = """\
# The seed's pool-a; idle models sleep after SLEEP s. It lists no agents: in embedded mode
# (serve --claims) the agent that runs the reconciler is the pool, named after its host.
kind: WarmPool
metadata:
  name: pool-a
  namespace: default
  labels:
    claim.model.aibrix.ai/pool: pool-a
    claim.model.aibrix.ai/enabled: "true"
spec:
  policy: {"lifecycle": {"sleepAfterSeconds": SLEEP}}
"""


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def post(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:200]


class DemoFailed(Exception):
    """The demo cannot go on; ``str()``: what to tell the user."""


class Agent:
    """The agent process the demo started, and its log."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def reason(self) -> str:
        """The last lines of the agent's log (its own one-line reason when it stopped)."""
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join("  " + line for line in lines[-8:]) or "  (its log is empty)"

    def alive(self) -> None:
        if (code := self.proc.poll()) is not None:
            raise DemoFailed(f"the agent exited with code {code}; its log says:\n"
                             f"{self.reason()}")


def wait_until(agent: Agent, test: Callable[[], bool], what: str,
               timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        agent.alive()  # checked first: another server on its port must not answer for it
        try:
            if test():
                return
        except (OSError, ValueError, KeyError, AgentError):
            pass
        time.sleep(0.2)
    agent.alive()
    raise DemoFailed(f"timed out after {timeout_s:.0f} s waiting for {what}; the agent's log "
                     f"ends with:\n{agent.reason()}")


def phases(rec_url: str) -> list[str]:
    """The claims' phases, as the reconciler lists them."""
    return sorted(c["status"]["phase"] for c in get(rec_url + "/v1/claims")["items"])


def chat(port: int, model: str) -> tuple[int, str]:
    """A chat request to the front door on ``port``."""
    status, body = post(f"http://127.0.0.1:{port}/v1/chat/completions",
                        {"model": model, "max_tokens": 12,
                         "messages": [{"role": "user", "content": "Say hello."}]})
    if status == 200:
        return status, body["choices"][0]["message"]["content"]
    return status, str(body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, default=8080, help="the agent's port")
    p.add_argument("--claims-port", type=int, default=8081, help="the reconciler's port")
    p.add_argument("--door-port", type=int, default=8000, help="the front door's port")
    p.add_argument("--state-dir", default=None)
    p.add_argument("--kv-shm-dir", default=None,
                   help="where the engines' KV segments live (the agent's default, /dev/shm, "
                        "when not given); another directory lets the demo run beside an agent "
                        "that already serves the same models")
    p.add_argument("--keep-running", action="store_true",
                   help="leave the agent up after the demo (Ctrl-C stops it)")
    p.add_argument("--keep-dir", action="store_true",
                   help="keep the temporary directory (state, claims, the agent's log)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="runtime-agent-demo-"))
    try:
        code = run(args, work)
    except DemoFailed as exc:
        print(f"\ndemo: {exc}", file=sys.stderr)
        code = 1
    if args.keep_dir:
        print(f"\nthe agent's log and state are kept in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
        if code:
            print("(--keep-dir keeps the agent's whole log and state)", file=sys.stderr)
    return code


def run(args: argparse.Namespace, work: Path) -> int:
    state_dir = Path(args.state_dir) if args.state_dir else work / "state"
    claims_dir = work / "claims"
    claims_dir.mkdir()
    (claims_dir / "pool.yaml").write_text(
        POOL.replace("SLEEP", str(SLEEP_AFTER_S)))
    agent_url = f"http://127.0.0.1:{args.port}"
    rec_url = f"http://127.0.0.1:{args.claims_port}"
    client = AgentClient(agent_url, timeout_s=60)
    step(f"starting the agent on :{args.port} with its reconciler on :{args.claims_port} and "
         f"its front door on :{args.door_port} (state in {state_dir}, claims in {claims_dir})")
    log_path = work / "agent.log"
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime_agent.cli", "serve", "--host", "127.0.0.1",
         "--port", str(args.port),
         "--state-dir", str(state_dir), "--log-format", "text", "--restart-delays", "1,2,4,8,16",
         "--scrape-interval", "0.5", "--claims", str(claims_dir),
         "--claims-port", str(args.claims_port), "--door-port", str(args.door_port),
         *(["--kv-shm-dir", args.kv_shm_dir] if args.kv_shm_dir else [])],
        cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
    log.close()
    agent = Agent(proc, log_path)
    try:
        door_url = f"http://127.0.0.1:{args.door_port}"
        wait_until(agent, lambda: client.health().get("status") == "ok"
                   and bool(get(rec_url + "/healthz")) and bool(get(door_url + "/healthz")),
                   "the agent, its reconciler and its door to answer", 30)
        snap = client.snapshot()
        print(f"engines: {'simulated' if snap['agent']['simulated_engines'] else 'vLLM'}; "
              f"GPU memory: {snap['node']['gpu_backend']}")

        step("the seed's sample claims go in (samples/modelclaim/modelclaims.yaml)")
        shutil.copy(ROOT / "samples" / "modelclaim" / "modelclaims.yaml", claims_dir)
        wait_until(agent, lambda: phases(rec_url) == ["Active", "Active"], "both claims Active")
        print(claims_table(get(rec_url + "/v1/claims")["items"]))
        print()
        print(snapshot_table(client.snapshot()))

        step(f"a chat request to qwen3-0.6b through the front door (:{args.door_port}), which "
             "follows the claim's route")
        routes = {r["model"]: r for r in get(rec_url + "/v1/routes")["routes"]}
        print(json.dumps(routes["qwen3-0.6b"]))
        status, text = chat(args.door_port, "qwen3-0.6b")
        print(f"HTTP {status}: {text}")
        print("models: " + ", ".join(f"{m['id']} ({m['state']}, context {m['max_model_len']})"
                                     for m in get(door_url + "/v1/models")["data"]))

        step(f"idle for {SLEEP_AFTER_S} s, both models are put to sleep")
        wait_until(agent, lambda: phases(rec_url) == ["Sleeping", "Sleeping"],
                   "both claims Sleeping", 60)
        print(claims_table(get(rec_url + "/v1/claims")["items"]))

        step("a request for the sleeping qwen3-0.6b: the door wakes it and holds the request")
        started = time.monotonic()
        status, text = chat(args.door_port, "qwen3-0.6b")
        print(f"HTTP {status} after {time.monotonic() - started:.2f} s: {text}")
        print(claims_table(get(rec_url + "/v1/claims")["items"]))

        step("qwen3-0.6b's engine is killed (SIGKILL); the agent restarts it on its port")
        pid = next(m["pid"] for m in client.snapshot()["models"] if m["model_name"] == "qwen3-0.6b")
        os.kill(pid, signal.SIGKILL)
        wait_until(agent, lambda: any(m["model_name"] == "qwen3-0.6b" and m["ready"]
                                      and m["pid"] != pid for m in client.snapshot()["models"]),
                   "qwen3 restarted")
        print(snapshot_table(client.snapshot()))

        step("engine events so far")
        for e in client.events(0)["events"]:
            first = e["message"].splitlines()[0] if e["message"] else ""
            print(f"  {e['model']}: {e['from']} -> {e['to']} ({e['reason']}) {first}")
        if args.keep_running:
            cli = ROOT / ".venv" / "bin" / "runtime-agent"
            step("running until Ctrl-C (which stops it and its engines); in a second terminal:")
            print(f"  {cli} snapshot --url {agent_url}\n"
                  f"  {cli} top --url {agent_url}\n"
                  f"  {cli} claims get --url {rec_url}\n"
                  f"  curl {door_url}/v1/models\n"
                  f"  the agent's log: {log_path}")
            try:
                proc.wait()
            except KeyboardInterrupt:
                pass
        step("the claims are deleted; the reconciler stops their engines")
        (claims_dir / "modelclaims.yaml").unlink()
        wait_until(agent, lambda: client.snapshot()["models"] == [], "engines stopped", 120)
        print(snapshot_table(client.snapshot()))
        return 0
    finally:
        if proc.poll() is None:
            for m in _models(client):  # best effort: leave no engine behind, even on failure
                client.deactivate(m)
            proc.terminate()
            proc.wait(15)


def _models(client: AgentClient) -> list[str]:
    try:
        return [m["model_name"] for m in client.snapshot()["models"]]
    except (OSError, AgentError):
        return []


if __name__ == "__main__":
    sys.exit(main())
