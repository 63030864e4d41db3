"""``runtime-agent``: the daemon (``serve``), the live view (``top``) and a client for its API.

This is the only module that reads flags and the environment; it turns them into Settings.
Every mistake on the command line or at start-up is one line on stderr with its own exit code
(``runtime_agent.preflight`` and the README's "Exit codes").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import shutil
import sys
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from msgspec.structs import replace

from contract.numbers import whole_number
from contract.quantity import size_type as _size

from runtime_agent import __version__
from runtime_agent.logs import setup_logging
from guard.exposure import INSECURE_FLAG, ExposureError, insecure_warning, is_loopback, \
    listen_host

# The start-up checks and the settings are imported where they are used: ``serve`` imports them
# with the garbage collector paused (``main``), and no other command needs them.
if TYPE_CHECKING:
    from reconciler.door.settings import DoorSettings
    from runtime_agent.settings import Settings

log = logging.getLogger("runtime_agent.cli")
PYDANTIC_PLUGINS = "PYDANTIC_DISABLE_PLUGINS"

DESCRIPTION = """\
The warm-pool runtime agent: supervises vLLM, SGLang and Ollama engine processes on a GPU
node (start, sleep, wake, restart, KV-cache limits, GPU memory per engine) and answers a
controller and people on port 8080. Without a GPU it runs simulated engines, and says so.

  runtime-agent serve [--claims DIR]     run the agent (and a reconciler for DIR beside it)
  runtime-agent top                      a live view of the node (sleep/wake/stop with keys)
  runtime-agent snapshot [-o wide]       the engines as a table
  runtime-agent claims get               the ModelClaims of a reconciler (port 8081)
  runtime-agent claims estimate DIR      a model's perGPU figures from its files
"""

EPILOG = """\
environment:
  RUNTIME_AGENT_URL         the agent's address for client commands (http://127.0.0.1:8080)
  RUNTIME_AGENT_TOKEN       the API's bearer token (serve: required of callers; clients: sent)
  RUNTIME_AGENT_TOKEN_FILE  a file holding that token (--token-file)
  RECONCILER_URL            the reconciler's address for `claims` (http://127.0.0.1:8081)
  RECONCILER_TOKEN_FILE     the reconciler API's token file (reconcile: asked of callers;
                            claims: sent); RECONCILER_TOKEN the token itself; default: the agents'
  AIBRIX_WEIGHT_CACHE_DIR   the weight cache's directory (serve --weight-cache-dir)
  HF_ENDPOINT, HF_TOKEN     the Hugging Face Hub the weight cache and engines use

without a token, serve and reconcile listen on 127.0.0.1 only; another --host needs a token
or --insecure-no-auth (exit 2 otherwise).

exit codes: 0 ok; 1 the API refused or the operation failed; 2 a flag is wrong;
  3 another agent holds --state-dir; 4 a directory the agent writes cannot be used;
  5 a port cannot be bound; 6 --gpu nvml finds no GPU; 7 a file the agent reads cannot be
  read (token, --claims); 8 the agent or reconciler cannot be reached; 130 interrupted.
"""


class Parser(argparse.ArgumentParser):
    """argparse, with every mistake in one line (argparse prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        from runtime_agent.preflight import EXIT_USAGE

        see = "" if "--help)" in message else f" (see {self.prog} --help)"
        self.exit(EXIT_USAGE, f"{self.prog}: {message}{see}\n")


def _port(text: str) -> int:
    port = whole_number(text)
    if port is None or not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1-65535)")
    return port


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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def _interval(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 (1: no slowing down)")
    return value


def _count(text: str) -> int:
    count = whole_number(text)
    if count is None or count < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return count


def _size_or_zero(text: str) -> int:
    return 0 if text.strip() == "0" else _size(text)



def _gpu_spec(text: str) -> str:
    from runtime_agent.gpu.simulated import parse_spec

    try:
        parse_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def gpu_present() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*"))


def engines_choice(choice: str) -> tuple[bool, str]:
    """(simulate engines?, why) for ``--engines``."""
    if choice == "sim":
        return True, "--engines sim"
    if choice == "vllm":
        return False, "--engines vllm"
    if not gpu_present():
        return True, "--engines auto and no GPU on this machine"
    if shutil.which("vllm") is None:
        return True, "--engines auto and no vllm executable on PATH"
    return False, "--engines auto found a GPU and vllm"


def settings_from(args: argparse.Namespace) -> Settings:
    from runtime_agent.preflight import EXIT_USAGE, StartupError, token_source_of
    from runtime_agent.settings import Settings

    simulate, _ = engines_choice(args.engines)
    cache = args.weight_cache_dir
    env = os.environ
    low, high = args.engine_ports
    token = token_source_of(args.token_file, env.get("RUNTIME_AGENT_TOKEN"))
    try:
        host = listen_host(args.host, token is not None, args.insecure_no_auth)
    except ExposureError as exc:
        raise StartupError(EXIT_USAGE, str(exc)) from None
    return Settings(
        host=host, port=args.port, state_dir=Path(args.state_dir), port_low=low,
        port_high=high, engine_bind_host=args.engine_host or _default_engine_host(args, host),
        health_probe_port=args.health_probe_port, restart_delays=args.restart_delays,
        engine_cgroups=args.engine_cgroups == "auto",
        stop_grace_s=args.stop_grace, probe_max_s=max(args.probe_max, 0.005),
        scrape_interval_s=args.scrape_interval, kv_shm_dir=Path(args.kv_shm_dir),
        kv_hold_s=args.kv_hold_interval, start_stall_s=args.start_stall_timeout,
        gpu_backend=args.gpu, simulate_gpus=args.simulate_gpus, gpu_reserve_bytes=args.gpu_reserve,
        gpu_sample_interval_s=args.gpu_sample_interval, host_reserve_bytes=args.host_reserve,
        vllm_command=tuple(args.vllm_command.split()),
        ollama_command=tuple(args.ollama_command.split()),
        sglang_command=tuple(args.sglang_command.split()),
        vllm_sleep_mode=(args.vllm_sleep_mode == "on" or (args.vllm_sleep_mode == "auto"
                                                          and (gpu_present() or simulate))),
        simulate_engines=simulate,
        weight_cache_dir=Path(cache) if cache else None,
        api_token=token,
        auth_reads=args.auth_reads,
        health_interval_s=args.health_interval, unresponsive_after=args.unresponsive_after,
        unresponsive_grace_s=args.unresponsive_grace, budget_reset_s=args.budget_reset,
        steady_backoff=args.steady_backoff, scrape_interval_max_s=args.scrape_interval_max,
        allow_trust_remote_code=args.allow_trust_remote_code,
        artifact_reserve_bytes=args.artifact_reserve,
        artifact_local_roots=tuple(Path(os.path.abspath(p)) for p in args.artifact_local_root),
        hf_endpoint=env.get("HF_ENDPOINT") or None, hf_token=env.get("HF_TOKEN") or None,
        s3_endpoint_url=args.s3_endpoint_url,
    )


def _default_engine_host(args: argparse.Namespace, api_host: str = "0.0.0.0") -> str:
    """Loopback when the embedded front door is the way in (``--claims`` without
    ``--no-door``) or the API itself listens on loopback only (engines answer anyone who
    reaches them: a node closed to the network keeps them closed too); every address
    otherwise."""
    door = getattr(args, "claims", None) and not getattr(args, "no_door", False) \
        and getattr(args, "door_port", None) is not None
    return "127.0.0.1" if door or is_loopback(api_host) else "0.0.0.0"


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run the daemon on uvloop where it is installed, as ``reconciler.runtime.loop`` runs the
    reconciler (that module's package brings the controller machinery a plain ``serve`` does
    not run)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a dependency on Linux
        asyncio.run(main)
        return
    uvloop.run(main)


def _started() -> None:
    """The API listens: the collector, paused by ``main`` while the start-up made objects that
    live as long as the agent, runs from here, and never walks those again (``gc.freeze``: a
    full collection of them took 30-50 ms, for a few hundred KiB of start-up garbage kept)."""
    gc.freeze()
    gc.enable()


@contextlib.contextmanager
def _without_pydantic_plugins() -> Iterator[None]:
    """No pydantic plugin for the agent's own models, made while this lasts. Pydantic looks
    for plugins in every installed distribution's entry points when its first model is made:
    131 of them here, hundreds in an engine image, and a third of the agent's own import time
    (issue 26). An operator's setting is kept; engines, which inherit this environment, see it
    as it was."""
    ours = PYDANTIC_PLUGINS not in os.environ
    if ours:
        os.environ[PYDANTIC_PLUGINS] = "__all__"
    try:
        yield
    finally:
        if ours:
            os.environ.pop(PYDANTIC_PLUGINS, None)


def _serve(args: argparse.Namespace) -> int:
    with _without_pydantic_plugins():
        from runtime_agent.agent import serve
        from runtime_agent.preflight import EXIT_PORT, EXIT_STATE_DIR_BUSY, StartupError, check
        from runtime_agent.statelock import StateDirBusy

        if args.claims:
            from reconciler.local.embedded import embedded_reconciler

    setup_logging(args.log_format, args.log_level)
    try:
        settings = settings_from(args)
        door = _door(args, settings.host)  # its keys file read before anything listens
        checked = check(settings, claims_dir=args.claims,
                        claims_port=args.claims_port if args.claims else None,
                        door=(door.host, door.port) if door is not None else None)
    except StartupError as exc:
        print(f"runtime-agent serve: {exc}", file=sys.stderr)
        return exc.code
    settings = replace(settings, engine_problems=tuple(checked.engine_problems.items()))
    _say_what_is_real(settings, args.engines)
    if settings.api_token is None and not is_loopback(settings.host):
        log.warning(insecure_warning("control API", settings.host, settings.port))
    for warning in checked.warnings:
        log.warning(warning)
    try:
        if args.claims:  # embedded single-node mode: this agent is the pool of a local reconciler
            companion = embedded_reconciler(settings.host, settings.port, args.claims,
                                            settings.host, args.claims_port,
                                            settings.api_token, door,
                                            settings.state_dir / "reconciler",
                                            auth_reads=settings.auth_reads)
            run_loop(serve(settings, checked.sockets, checked.probe_sockets, companion,
                           started=_started))
        else:
            run_loop(serve(settings, checked.sockets, checked.probe_sockets, started=_started))
    except StateDirBusy as exc:
        print(f"runtime-agent serve: {exc}", file=sys.stderr)
        return EXIT_STATE_DIR_BUSY
    except OSError as exc:
        if exc.errno is None or not _is_bind_error(exc):
            raise
        print(f"runtime-agent serve: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_PORT
    finally:
        checked.close()
    return 0


def _door(args: argparse.Namespace, host: str) -> DoorSettings | None:
    """The embedded door's settings (None without --claims, or with --no-door); a keys file
    that cannot be used is a StartupError."""
    if not args.claims:
        return None
    from reconciler.cli import checked_door_settings
    from reconciler.door.keys import KeysError
    from runtime_agent.preflight import EXIT_UNREADABLE, StartupError

    try:
        return checked_door_settings(args, host)
    except KeysError as exc:
        raise StartupError(EXIT_UNREADABLE, f"--door-api-keys: {exc}") from None


def _is_bind_error(exc: OSError) -> bool:
    import errno

    return exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL)


def _say_what_is_real(settings: Settings, choice: str) -> None:
    """One line at start saying whether engines are real or simulated, and why."""
    simulate, why = engines_choice(choice)
    if simulate:
        log.warning("engines are SIMULATED (%s): every activation, whatever its engine, runs "
                    "python -m engines.sim, which speaks that engine's API and refuses flags it "
                    "does not have, but runs no model; snapshots and metrics mark them "
                    "simulated", why)
    else:
        log.info("engines are real (%s): vllm, sglang and ollama run as installed", why)


def _top(args: argparse.Namespace) -> int:
    from runtime_agent.console.top import run_top

    return run_top(args)


def serve_parser(sub: Any) -> None:
    from reconciler.options import add_serve_options
    from runtime_agent.settings import DEFAULT_STATE_DIR

    env = os.environ
    s = sub.add_parser("serve", help="run the agent daemon",
                       description="Run the runtime agent. Every start-up mistake ends it at "
                       "once with one line on stderr and its own exit code (see runtime-agent "
                       "--help), before it takes over any engine.", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    api = s.add_argument_group("the control API")
    api.add_argument("--host", default=None,
                     help="address of the control API, the embedded reconciler and its door "
                     "(default: 127.0.0.1 without a token, every interface with one; any other "
                     f"address without a token needs {INSECURE_FLAG})")
    api.add_argument(INSECURE_FLAG, action="store_true",
                     help="let the API listen beyond loopback without a token: anyone who "
                     "reaches it can start, stop and wake engines (the AIBrix controller "
                     "sends no token; restrict who reaches the port, e.g. a NetworkPolicy). "
                     "Default address with it: every interface")
    api.add_argument("--port", type=_port, default=8080, help="its port (default %(default)s)")
    api.add_argument("--health-probe-port", type=_port, default=None,
                     help="also answer /healthz and /ready on this port, from a process of "
                     "their own: fast while the API is busy, and 503 when the agent's event "
                     "loop has stalled (point the kubelet's probes here; default: off)")
    api.add_argument("--token-file", default=env.get("RUNTIME_AGENT_TOKEN_FILE"),
                     help="a file holding the API's bearer token; every call that changes "
                     "something must carry it (env RUNTIME_AGENT_TOKEN_FILE, or the token "
                     "itself in RUNTIME_AGENT_TOKEN; default: no token)")
    api.add_argument("--auth-reads", action="store_true",
                     help="reads need the token too (/healthz, /ready and /metrics stay open)")
    api.add_argument("--log-format", choices=("json", "text"), default="json",
                     help="the agent's log on stderr: json lines or text (default %(default)s)")
    api.add_argument("--log-level", type=str.lower, default="info",
                     choices=("debug", "info", "warning", "error", "critical"),
                     help="default %(default)s")
    st = s.add_argument_group("state")
    st.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR),
                    help="the engine registry and engine logs; one agent per directory "
                    "(default %(default)s)")
    st.add_argument("--kv-shm-dir", default="/dev/shm",
                    help="where kvcached segments live (default %(default)s)")
    eng = s.add_argument_group("engines")
    eng.add_argument("--engines", choices=("auto", "vllm", "sim"), default="auto",
                     help="auto: real engines when a GPU and vllm are present, else simulated "
                     "ones; vllm: always real (vllm, sglang, ollama as installed); sim: always "
                     "simulated (default %(default)s)")
    eng.add_argument("--engine-ports", type=_port_range, default=(20000, 20999),
                     help="engines listen on a port of this range for their whole life "
                     "(default 20000-20999)")
    eng.add_argument("--engine-host", default=None,
                     help="the address engines listen on (default 0.0.0.0; 127.0.0.1 with "
                     "--claims and its front door, the only way in, or when the API listens "
                     "on loopback)")
    eng.add_argument("--vllm-command", default="vllm serve",
                     help="how to run vLLM, before MODEL and its flags (default '%(default)s')")
    eng.add_argument("--sglang-command", default="python3 -m sglang.launch_server",
                     help="how to run SGLang, before --model-path and its flags "
                     "(default '%(default)s')")
    eng.add_argument("--ollama-command", default="ollama serve",
                     help="how to run Ollama (default '%(default)s')")
    eng.add_argument("--vllm-sleep-mode", choices=("auto", "on", "off"), default="auto",
                     help="auto: on with a GPU or simulated engines (vLLM on CPU refuses "
                     "--enable-sleep-mode) (default %(default)s)")
    eng.add_argument("--allow-trust-remote-code", action="store_true",
                     help="let activations pass --trust-remote-code (runs a model "
                     "repository's code on this node; default: refused)")
    sup = s.add_argument_group("supervision")
    sup.add_argument("--restart-delays", type=_delays, default=(2.0, 4.0, 8.0, 16.0, 32.0),
                     help="seconds before restarts 1..N; the engine fails after N "
                     "(default 2,4,8,16,32)")
    sup.add_argument("--budget-reset", type=_seconds, default=600.0,
                     help="seconds an engine must serve without a crash before its restart "
                     "budget starts again (default %(default)g)")
    sup.add_argument("--stop-grace", type=_seconds, default=10.0,
                     help="seconds between SIGTERM and SIGKILL of an engine's process group "
                     "(default %(default)g)")
    sup.add_argument("--engine-cgroups", choices=("auto", "off"), default="auto",
                     help="auto: run each engine in its own cgroup (v2) where the agent can "
                     "create one, so everything it forks dies with it; off: process group "
                     "and engine id only (default %(default)s)")
    sup.add_argument("--start-stall-timeout", type=_interval, default=600.0,
                     help="seconds a booting engine may go without opening its port or "
                     "logging (default %(default)g)")
    sup.add_argument("--probe-max", type=_interval, default=0.05,
                     help="longest gap between readiness probes of a booting engine, seconds "
                     "(default %(default)g)")
    sup.add_argument("--health-interval", type=_interval, default=1.0,
                     help="seconds between health probes of a ready engine (default %(default)g)")
    sup.add_argument("--unresponsive-after", type=_count, default=3,
                     help="missed probes in a row before an engine is not ready "
                     "(default %(default)s)")
    sup.add_argument("--unresponsive-grace", type=_seconds, default=30.0,
                     help="seconds an unresponsive engine is given before it is restarted "
                     "(default %(default)g)")
    sup.add_argument("--scrape-interval", type=_interval, default=2.0,
                     help="seconds between scrapes of an engine's /metrics (default %(default)g)")
    sup.add_argument("--scrape-interval-max", type=_interval, default=20.0,
                     help="seconds a steady engine's scrapes back off to at most (default "
                     "%(default)g; a controller's last look before an idle sleep reads the "
                     "engine itself: the snapshot with ?fresh=requests; keep 2 under AIBrix's "
                     "controller, which does not ask for it)")
    sup.add_argument("--steady-backoff", type=_factor, default=10.0,
                     help="while nothing changes, health probes, scrapes and KV checks of an "
                     "engine slow down, doubling, to this many times their interval; any change "
                     "or missed probe brings them back (default %(default)g; 1: never)")
    mem = s.add_argument_group("GPU and host memory (sizes take units: 1GiB, 512MiB, 6Gi)")
    mem.add_argument("--gpu", choices=("auto", "nvml", "sim"), default="auto",
                     help="GPU memory source: auto = NVML when it finds a GPU, else simulated "
                     "(default %(default)s)")
    mem.add_argument("--simulate-gpus", type=_gpu_spec, default="1x80GiB",
                     help="simulated cards, COUNTxSIZE, e.g. 2x141GiB (default %(default)s)")
    mem.add_argument("--gpu-reserve", type=_size, default=1 << 30,
                     help="per card, kept out of every budget (CUDA context, fragmentation; "
                     "default 1GiB)")
    mem.add_argument("--host-reserve", type=_size, default=2 << 30,
                     help="host memory kept out of the budget for sleeping engines' weights "
                     "(default 2GiB)")
    mem.add_argument("--gpu-sample-interval", type=_interval, default=1.0,
                     help="seconds between GPU samples (default %(default)g)")
    mem.add_argument("--kv-hold-interval", type=_interval, default=1.0,
                     help="seconds between checks that each KV limit still holds "
                     "(default %(default)g)")
    wc = s.add_argument_group("the weight cache")
    wc.add_argument("--weight-cache-dir", default=env.get("AIBRIX_WEIGHT_CACHE_DIR"),
                    help="where artifacts are staged (env AIBRIX_WEIGHT_CACHE_DIR; default: "
                    "the cache is off)")
    wc.add_argument("--artifact-reserve", type=_size_or_zero, default=1 << 30,
                    help="disk space the weight cache always leaves free (default 1GiB)")
    wc.add_argument("--artifact-local-root", action="append", default=[],
                    help="a directory whose files the cache may copy (repeatable; default none)")
    wc.add_argument("--s3-endpoint-url", default=env.get("AWS_ENDPOINT_URL_S3")
                    or env.get("AWS_ENDPOINT_URL"),
                    help="an S3-compatible endpoint for s3:// artifacts (env "
                    "AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL; default: AWS)")
    s.set_defaults(func=_serve)
    add_serve_options(s)  # --claims DIR [--claims-port P]: the embedded reconciler


def parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line; with ``command="serve"`` only ``serve`` is known, so that the daemon
    imports none of the client commands, the live view or the reconciler to read its flags."""
    p = Parser(prog="runtime-agent", description=DESCRIPTION, epilog=EPILOG,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"runtime-agent {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser(sub)
    if command == "serve":
        return p
    from runtime_agent.console.commands import add_agent_options
    from runtime_agent.console.commands import add_commands as add_client_commands

    t = sub.add_parser("top", help="a live view of the node: memory per card, engines, keys to "
                       "sleep, wake and stop",
                       description="A live view of one agent, refreshed from its events feed. "
                       "Keys: up/down select an engine, s sleep, w wake, x stop (asks first), "
                       "q quit.")
    add_agent_options(t)
    t.set_defaults(func=_top)
    add_client_commands(sub)  # snapshot, activate, deactivate, sleep, wake, kv-limit, logs...
    from reconciler.cli import add_commands

    add_commands(sub)  # reconcile --claims DIR --pool FILE; claims get|describe
    from runtime_agent.console.artifacts import add_commands as add_artifact_commands

    add_artifact_commands(sub)  # download URL; artifacts
    return p


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    serving = words[:1] == ["serve"]  # the daemon: its parser alone (see ``parser``)
    if serving:
        # Start-up makes about 90,000 objects (modules, classes, schemas) that live as long as
        # the agent; collections in between free next to nothing and cost about a tenth of the
        # imports (issue 26). Paused until the API listens (``_started``).
        gc.disable()
    try:
        return _command(words, serving)
    finally:
        gc.enable()


def _command(words: list[str], serving: bool) -> int:
    if not serving:
        from runtime_agent.console.commands import join_arg_values

        words = join_arg_values(words)
    top = parser("serve" if serving else None)
    args, unknown = top.parse_known_args(words)
    if unknown:  # point at the command's own help, where its flags are listed
        command = " ".join(c for c in (args.command, getattr(args, "claims_command", None)) if c)
        top.error(f"unrecognized arguments: {' '.join(unknown)} (see {top.prog} {command} "
                  "--help)")
    try:
        if args.command in ("serve", "reconcile", "top"):
            return int(args.func(args))
        from runtime_agent.console.output import quiet_on_closed_pipe

        return quiet_on_closed_pipe(lambda: int(args.func(args)))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
