"""Demo: the agent on its embedded default, driving the seed's two sample models end to end.

Starts ``runtime-agent serve`` (simulated engines when no GPU is present) with a throw-away
state directory, activates qwen3-0.6b and qwen2.5-0.5b as the seed's sample claims do, sends a
chat request, puts one model to sleep and wakes it, kills one engine to show the restart, and
prints the snapshot table after each step. Everything it started is stopped at the end, unless
--keep-running is given.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime_agent.cli import _table  # noqa: E402
from runtime_agent.client import AgentClient, AgentError  # noqa: E402

SAMPLES = [("qwen3-0.6b", "huggingface://Qwen/Qwen3-0.6B"),
           ("qwen2.5-0.5b", "huggingface://Qwen/Qwen2.5-0.5B-Instruct")]


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def wait_until(client: AgentClient, test, what: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    cursor = 0
    while time.monotonic() < deadline:
        snap = client.snapshot()
        if test(snap):
            return snap
        cursor = client.events(cursor, wait=1)["cursor"]
    raise SystemExit(f"demo: timed out waiting for {what}")


def phases(snap: dict) -> dict[str, str]:
    return {m["model_name"]: m["phase"] for m in snap["models"]}


def chat(port: int, model: str) -> tuple[int, str]:
    body = json.dumps({"model": model, "max_tokens": 12,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()[:120]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--state-dir", default=None)
    p.add_argument("--keep-running", action="store_true")
    args = p.parse_args()
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="runtime-agent-demo-"))
    url = f"http://127.0.0.1:{args.port}"
    client = AgentClient(url, timeout_s=60)
    step(f"starting the agent on :{args.port} (state in {state_dir})")
    agent = subprocess.Popen(
        [sys.executable, "-m", "runtime_agent.cli", "serve", "--port", str(args.port),
         "--state-dir", str(state_dir), "--log-format", "text", "--restart-delays", "1,2,4,8,16",
         "--scrape-interval", "0.5"],
        cwd=ROOT, stderr=open(state_dir / "agent.log", "ab"), start_new_session=True)
    try:
        for _ in range(200):
            try:
                client.health()
                break
            except (OSError, AgentError):
                if agent.poll() is not None:
                    print((state_dir / "agent.log").read_text()[-2000:])
                    raise SystemExit(f"demo: the agent exited ({agent.returncode})") from None
                time.sleep(0.05)
        snap = client.snapshot()
        print(f"engines: {'simulated' if snap['agent']['simulated_engines'] else 'vLLM'}")

        step("activating the seed's two sample models")
        ports = {}
        for name, artifact in SAMPLES:
            # The seed's samples: 6 GiB footprint and a 1 GiB KV floor per GPU; a 2 GiB KV limit.
            result = client.activate(
                name, artifact, "vllm", args={"--max-model-len": "2048"},
                per_gpu={"maximum_footprint_bytes": 6 << 30, "kv_floor_bytes": 1 << 30},
                kv_limit_bytes=2 << 30)
            ports[name] = result["port"]
            print(f"{name}: port {result['port']}, pid {result['pid']}, phase {result['phase']}")
        snap = wait_until(client, lambda s: set(phases(s).values()) == {"active"}, "both active")
        print(_table(snap))

        step("a chat request to qwen3-0.6b")
        status, text = chat(ports["qwen3-0.6b"], "qwen3-0.6b")
        print(f"HTTP {status}: {text}")

        step("qwen2.5-0.5b goes to sleep (level 1); requests to it get 503")
        print(json.dumps(client.sleep("qwen2.5-0.5b", 1, operation_id="demo-sleep-1")))
        print(f"request while asleep: HTTP {chat(ports['qwen2.5-0.5b'], 'qwen2.5-0.5b')[0]}")
        print(_table(client.snapshot()))

        step("waking it; it serves again")
        print(json.dumps(client.wake("qwen2.5-0.5b", operation_id="demo-wake-1")))
        print(f"request after wake: HTTP {chat(ports['qwen2.5-0.5b'], 'qwen2.5-0.5b')[0]}")

        step("qwen3-0.6b's engine is killed (SIGKILL); the agent restarts it on its port")
        pid = next(m["pid"] for m in client.snapshot()["models"] if m["model_name"] == "qwen3-0.6b")
        os.kill(pid, signal.SIGKILL)
        snap = wait_until(client, lambda s: any(m["model_name"] == "qwen3-0.6b" and m["ready"]
                                                and m["pid"] != pid for m in s["models"]),
                          "qwen3-0.6b restarted")
        print(_table(snap))

        step("events so far")
        for e in client.events(0)["events"]:
            first = e["message"].splitlines()[0] if e["message"] else ""
            print(f"  {e['model']}: {e['from']} -> {e['to']} ({e['reason']}) {first}")
        if args.keep_running:
            step(f"the agent keeps running at {url}; try: runtime-agent snapshot --url {url}"
                 " (Ctrl-C stops it and its engines)")
            try:
                agent.wait()
            except KeyboardInterrupt:
                pass
        step("deactivating both models")
        for name, _ in SAMPLES:
            print(json.dumps(client.deactivate(name)))
        print(_table(client.snapshot()))
        return 0
    finally:
        if agent.poll() is None:
            for m in _models(client):  # best effort: leave no engine behind, even on failure
                client.deactivate(m)
            agent.terminate()
            agent.wait(15)


def _models(client: AgentClient) -> list[str]:
    try:
        return [m["model_name"] for m in client.snapshot()["models"]]
    except (OSError, AgentError):
        return []


if __name__ == "__main__":
    sys.exit(main())
