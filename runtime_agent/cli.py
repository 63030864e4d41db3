"""``runtime-agent``: the daemon (``serve``) and a client for its API (snapshot, activate, ...).

This is the only module that reads flags and the environment; it turns them into Settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from contract.quantity import QuantityError, parse_size
from runtime_agent.client import AgentClient, AgentError, read_token
from runtime_agent.logs import setup_logging
from runtime_agent.settings import DEFAULT_STATE_DIR, Settings


def _port_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(p) for p in text.split("-", 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH, got {text!r}") from None
    if not 1 <= low <= high <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port range {text!r}")
    return low, high


def _delays(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated seconds, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("restart delays must not be negative")
    return values


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except QuantityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else _size(text)


def gpu_present() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*"))


def settings_from(args: argparse.Namespace) -> Settings:
    engines = args.engines
    if engines == "auto":
        engines = "vllm" if gpu_present() and shutil.which("vllm") else "sim"
    cache = args.weight_cache_dir
    env = os.environ
    low, high = args.engine_ports
    return Settings(
        host=args.host, port=args.port, state_dir=Path(args.state_dir), port_low=low,
        port_high=high, engine_bind_host=args.engine_host or _default_engine_host(args),
        restart_delays=args.restart_delays, engine_cgroups=args.engine_cgroups == "auto",
        stop_grace_s=args.stop_grace, probe_max_s=max(args.probe_max, 0.005),
        scrape_interval_s=args.scrape_interval, kv_shm_dir=Path(args.kv_shm_dir),
        kv_hold_s=args.kv_hold_interval, start_stall_s=args.start_stall_timeout,
        gpu_backend=args.gpu, simulate_gpus=args.simulate_gpus, gpu_reserve_bytes=args.gpu_reserve,
        gpu_sample_interval_s=args.gpu_sample_interval, host_reserve_bytes=args.host_reserve,
        vllm_command=tuple(args.vllm_command.split()),
        ollama_command=tuple(args.ollama_command.split()),
        sglang_command=tuple(args.sglang_command.split()),
        vllm_sleep_mode=(args.vllm_sleep_mode == "on" or (args.vllm_sleep_mode == "auto"
                                                          and (gpu_present() or engines == "sim"))),
        simulate_engines=engines == "sim",
        weight_cache_dir=Path(cache) if cache else None,
        api_token=read_token(args.token_file), auth_reads=args.auth_reads,
        health_interval_s=args.health_interval, unresponsive_after=args.unresponsive_after,
        unresponsive_grace_s=args.unresponsive_grace, budget_reset_s=args.budget_reset,
        allow_trust_remote_code=args.allow_trust_remote_code,
        artifact_reserve_bytes=args.artifact_reserve,
        artifact_local_roots=tuple(Path(os.path.abspath(p)) for p in args.artifact_local_root),
        hf_endpoint=env.get("HF_ENDPOINT") or None, hf_token=env.get("HF_TOKEN") or None,
        s3_endpoint_url=args.s3_endpoint_url,
    )


def _default_engine_host(args: argparse.Namespace) -> str:
    """Loopback when the embedded front door is the way in (``--claims`` without
    ``--no-door``); every address otherwise."""
    door = getattr(args, "claims", None) and not getattr(args, "no_door", False) \
        and getattr(args, "door_port", None) is not None
    return "127.0.0.1" if door else "0.0.0.0"


EXIT_STATE_DIR_BUSY = 3


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run the daemon on uvloop where it is installed (Linux, a dependency): the control API
    answers about 1.5x the requests per second of asyncio's own loop (bench/bench_costs.py)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def _serve(args: argparse.Namespace) -> int:
    from runtime_agent.agent import serve
    from runtime_agent.statelock import StateDirBusy

    setup_logging(args.log_format, args.log_level)
    settings = settings_from(args)
    try:
        if args.claims:  # embedded single-node mode: this agent is the pool of a local reconciler
            from reconciler.cli import door_settings, serve_with_claims

            run_loop(serve_with_claims(serve(settings), args.host, settings.port, args.claims,
                                       args.host, args.claims_port, settings.api_token,
                                       door_settings(args, args.host)))
        else:
            run_loop(serve(settings))
    except StateDirBusy as exc:
        print(f"runtime-agent: {exc}", file=sys.stderr)
        return EXIT_STATE_DIR_BUSY
    return 0


def _table(snapshot: dict[str, Any]) -> str:
    cols = ("MODEL", "ENGINE", "PHASE", "READY", "PORT", "PID", "RESTARTS", "RUNNING",
            "WAITING", "HBM", "KV LIMIT", "KV APPLIED", "KV USED", "LAST ERROR")
    rows = [cols]
    for m in snapshot.get("models", []):
        err = (m.get("last_error") or "").splitlines()
        notes = [*m.get("conditions", []), *(err[:1])]
        rows.append((m["model_name"], m["engine"], m["phase"], str(m["ready"]).lower(),
                     str(m["port"]), str(m["pid"] or "-"), str(m["restart_count"]),
                     _num(m.get("requests_running")), _num(m.get("requests_waiting")),
                     _bytes(m.get("hbm_bytes")), _bytes(m.get("kv_limit_requested_bytes")),
                     _bytes(m.get("kv_limit_applied_bytes")), _bytes(m.get("kv_used_bytes")),
                     "; ".join(notes)[:70]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    for gpu in snapshot.get("accelerators", []):
        lines.append(f"GPU {gpu['index']} {gpu['name']}: {_bytes(gpu['hbm_used_bytes'])} used of "
                     f"{_bytes(gpu['hbm_total_bytes'])}, {_bytes(gpu.get('hbm_room_bytes'))} "
                     "room after claims")
    cached = snapshot.get("cached_artifacts") or []
    lines.append(f"\nobserved at {snapshot.get('observed_at')}; cached artifacts: "
                 f"{', '.join(cached) if cached else 'none'}")
    return "\n".join(lines)


def _bytes(value: Any) -> str:
    if value is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value}B"


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:g}"


def _client_command(args: argparse.Namespace) -> int:
    client = AgentClient(args.url, token=read_token(args.token_file))
    try:
        if args.command == "snapshot":
            snap = client.snapshot()
            print(json.dumps(snap, indent=2) if args.output == "json" else _table(snap))
            return 0
        if args.command == "events":
            return _follow(client, args.follow)
        if args.command == "logs":
            for line in client.logs(args.model, args.tail)["lines"]:
                print(line)
            return 0
        result = _dispatch(client, args)
    except AgentError as exc:
        print(f"error ({exc.status}): {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"cannot reach the agent at {args.url}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0 if result.get("status") == "success" else 1


def _dispatch(client: AgentClient, args: argparse.Namespace) -> dict[str, Any]:
    if args.command == "activate":
        flags: dict[str, str] = {}
        for item in args.arg:
            flag, _, value = item.partition("=")
            flags[flag] = value
        return client.activate(args.model, args.artifact, args.engine, args.engine_port, flags)
    if args.command == "deactivate":
        return client.deactivate(args.model)
    if args.command == "kv-limit":
        return client.kv_limit(args.model, args.bytes, args.operation_id)
    if args.command == "sleep":
        return client.sleep(args.model, args.level, args.operation_id)
    return client.wake(args.model, args.operation_id)


def _follow(client: AgentClient, follow: bool) -> int:
    cursor = 0
    while True:
        page = client.events(cursor, wait=30 if follow else 0)
        for item in page["events"]:
            when = time.strftime("%H:%M:%S", time.localtime(item["ts"]))
            who = item["model"] or item.get("artifact_url", "")
        print(f"{when} {who}: {item['from']} -> {item['to']} "
                  f"({item['reason']}) {item['message'].splitlines()[0] if item['message'] else ''}",
                  flush=True)
        cursor = page["cursor"]
        if not follow:
            return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="runtime-agent", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the agent daemon")
    s.add_argument("--host", default="0.0.0.0",
                   help="address of the control API (0.0.0.0: every interface; set a token)")
    s.add_argument("--token-file", default=os.environ.get("RUNTIME_AGENT_TOKEN_FILE"),
                   help="a file holding the API's bearer token (or RUNTIME_AGENT_TOKEN): every "
                   "call that changes something must carry it")
    s.add_argument("--auth-reads", action="store_true",
                   help="reads need the token too (/healthz, /ready and /metrics stay open)")
    s.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between health probes of a ready engine")
    s.add_argument("--unresponsive-after", type=int, default=3,
                   help="missed probes in a row before an engine is not ready")
    s.add_argument("--unresponsive-grace", type=float, default=30.0,
                   help="seconds an unresponsive engine is given before it is restarted")
    s.add_argument("--budget-reset", type=float, default=600.0,
                   help="seconds an engine must serve without a crash before its restart "
                   "budget starts again")
    s.add_argument("--allow-trust-remote-code", action="store_true",
                   help="let activations pass --trust-remote-code (runs a model repository's "
                   "code on this node)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR))
    s.add_argument("--engines", choices=("auto", "vllm", "sim"), default="auto",
                   help="engine binaries: auto = real vLLM when a GPU and vllm are present, "
                   "else the simulated engine")
    s.add_argument("--engine-ports", type=_port_range, default=(20000, 20999))
    s.add_argument("--engine-host", default=None,
                   help="address engines listen on (default 0.0.0.0; 127.0.0.1 with --claims "
                   "and its front door, the only way in)")
    s.add_argument("--restart-delays", type=_delays, default=(2.0, 4.0, 8.0, 16.0, 32.0),
                   help="seconds before restarts 1..N (default 2,4,8,16,32)")
    s.add_argument("--stop-grace", type=float, default=10.0)
    s.add_argument("--engine-cgroups", choices=("auto", "off"), default="auto",
                   help="auto: run each engine in its own cgroup (v2) where the agent can "
                        "create one, so everything it forks dies with it; off: process group "
                        "and engine id only")
    s.add_argument("--probe-max", type=float, default=0.05,
                   help="longest gap between readiness probes of a booting engine, seconds")
    s.add_argument("--scrape-interval", type=float, default=2.0,
                   help="seconds between scrapes of an engine's /metrics")
    s.add_argument("--start-stall-timeout", type=float, default=600.0,
                   help="seconds a booting engine may go without opening its port or logging")
    s.add_argument("--vllm-command", default="vllm serve",
                   help="how to run vLLM, before MODEL and its flags (split on spaces)")
    s.add_argument("--ollama-command", default="ollama serve")
    s.add_argument("--sglang-command", default="python3 -m sglang.launch_server",
                   help="how to run SGLang, before --model-path and its flags (split on spaces)")
    s.add_argument("--vllm-sleep-mode", choices=("auto", "on", "off"), default="auto",
                   help="auto: on with a GPU or simulated engines (vLLM on CPU refuses "
                   "--enable-sleep-mode)")
    s.add_argument("--gpu", choices=("auto", "nvml", "sim"), default="auto",
                   help="GPU memory source: auto = NVML when it finds a GPU, else simulated")
    s.add_argument("--simulate-gpus", default="1x80GiB",
                   help="simulated cards, COUNTxSIZE (e.g. 2x141GiB)")
    s.add_argument("--gpu-reserve", type=_size, default=1 << 30,
                   help="per card, kept out of every budget (CUDA context, fragmentation)")
    s.add_argument("--gpu-sample-interval", type=float, default=1.0)
    s.add_argument("--host-reserve", type=_size, default=2 << 30,
                   help="host memory kept out of the budget for sleeping engines' weights")
    s.add_argument("--kv-hold-interval", type=float, default=1.0,
                   help="seconds between checks that each KV limit still holds")
    s.add_argument("--kv-shm-dir", default="/dev/shm",
                   help="where kvcached segments live (tests point it at a temp dir)")
    s.add_argument("--weight-cache-dir", default=os.environ.get("AIBRIX_WEIGHT_CACHE_DIR"),
                   help="the weight cache (default: $AIBRIX_WEIGHT_CACHE_DIR; unset: off)")
    s.add_argument("--artifact-reserve", type=_size_or_zero, default=1 << 30,
                   help="disk space the weight cache always leaves free (default 1GiB)")
    s.add_argument("--artifact-local-root", action="append", default=[],
                   help="a directory whose files the cache may copy (repeatable)")
    s.add_argument("--s3-endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL_S3")
                   or os.environ.get("AWS_ENDPOINT_URL"),
                   help="an S3-compatible endpoint for s3:// artifacts")
    s.add_argument("--log-format", choices=("json", "text"), default="json")
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=_serve)
    from reconciler.cli import add_commands, add_serve_options

    add_serve_options(s)  # serve --claims DIR [--claims-port 8081]

    def client_parser(name: str, help_text: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help_text)
        c.add_argument("--url", default=os.environ.get("RUNTIME_AGENT_URL",
                                                       "http://127.0.0.1:8080"))
        c.add_argument("--token-file", default=os.environ.get("RUNTIME_AGENT_TOKEN_FILE"),
                       help="the agent's bearer token (or RUNTIME_AGENT_TOKEN)")
        c.set_defaults(func=_client_command)
        return c

    c = client_parser("snapshot", "print the engines as a table (-o json for JSON)")
    c.add_argument("-o", "--output", choices=("table", "json"), default="table")
    c = client_parser("activate", "start an engine for a model")
    c.add_argument("model")
    c.add_argument("--artifact", required=True, help="e.g. huggingface://Qwen/Qwen3-0.6B")
    c.add_argument("--engine", default="vllm", choices=("vllm", "ollama", "sim"))
    c.add_argument("--engine-port", type=int, default=0)
    c.add_argument("--arg", action="append", default=[], help="engine flag, --flag=value")
    client_parser("deactivate", "stop a model's engine").add_argument("model")
    c = client_parser("sleep", "put a model's engine to sleep")
    c.add_argument("model")
    c.add_argument("--level", type=int, choices=(1, 2), default=1)
    c.add_argument("--operation-id")
    c = client_parser("wake", "wake a model's engine")
    c.add_argument("model")
    c.add_argument("--operation-id")
    c = client_parser("kv-limit", "set a model's KV-cache limit (bytes)")
    c.add_argument("model")
    c.add_argument("bytes", type=int)
    c.add_argument("--operation-id")
    c = client_parser("logs", "print the last lines of a model's engine log")
    c.add_argument("model")
    c.add_argument("--tail", type=int, default=100)
    c = client_parser("events", "print engine events (-f to follow)")
    c.add_argument("-f", "--follow", action="store_true")
    add_commands(sub)  # reconcile --claims DIR --pool FILE; claims get|describe
    from runtime_agent.artifacts.commands import add_commands as add_artifact_commands

    add_artifact_commands(sub)  # download URL; artifacts
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
