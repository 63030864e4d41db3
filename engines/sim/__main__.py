"""Process lifecycle of the simulated engine: ``python -m engines.sim serve MODEL [vLLM flags] [--sim-*]``.

A supervisor must not be able to tell this process from ``vllm serve``: the port stays closed while
the "model loads", log lines look like vLLM's, SIGTERM/SIGINT shut it down cleanly with exit code 0,
and an optional child process mimics vLLM's API-server -> EngineCore process tree. Fault injection
(hang on start, crash after a delay) lives here too because it concerns the process, not HTTP.

``--sim-mode sglang`` serves SGLang's API instead (``engines.sim.sglang_api``).
``python -m engines.sim serve --sim-mode ollama`` is one ``ollama serve`` instead: same lifecycle and
fault injection, Ollama's log lines, its API (``engines.sim.ollama_api``) on ``OLLAMA_HOST``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from aiohttp import web
from prometheus_client import disable_created_metrics

from engines.sim import logs
from engines.sim.gpu_feed import MemoryFeed
from engines.sim.ollama_app import build_ollama_app
from engines.sim.ollama_state import OLLAMA_SIM_VERSION, OllamaState
from engines.sim.options import OptionsError, SimOptions, parse_options
from engines.sim.server import SIM_VERSION, build_app, dev_mode_enabled
from engines.sim.sglang_api import SGLANG_SIM_VERSION, build_sglang_app
from engines.sim.state import EngineState

PROCESS_START = time.monotonic()
SHUTDOWN_TIMEOUT_S = 0.1  # aiohttp waits this twice for in-flight requests; exit stays well under 1 s
CHILD_MARKER = "sim-engine-core"
# The child stays in our process group (no setsid); like vLLM's EngineCore it does not notice its
# parent's death, so only a group kill (or our clean shutdown) ends it. SIGINT is left to the parent.
CHILD_CODE = (
    "import signal, time\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "while True:\n"
    "    time.sleep(3600)\n"
)


def _crash(exit_code: int) -> None:
    logs.engine_log("ERROR", "simulated crash: EngineCore encountered a fatal error.", "core_client.py")
    logs.server_log("ERROR", "simulated crash")
    os._exit(exit_code)


def _spawn_child() -> subprocess.Popen[bytes]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_CODE, CHILD_MARKER],
        stdin=subprocess.DEVNULL,
        close_fds=True,
    )
    logs.engine_log("INFO", f"Started EngineCore child process [{child.pid}]", "core_client.py")
    return child


def _spawn_escaped(hidden: bool = False) -> None:
    """A helper that leaves the engine's process group (its own session), as a daemonising
    tool would: only the engine id in its environment ties it to the engine. ``hidden``: with
    an empty environment as well (``env -i``): only the engine's cgroup holds it."""
    marker = CHILD_MARKER + ("-hidden" if hidden else "-escaped")
    child = subprocess.Popen([sys.executable, "-c", CHILD_CODE, marker], stdin=subprocess.DEVNULL,
                             close_fds=True, start_new_session=True, env={} if hidden else None)
    logs.engine_log("INFO", f"Started a helper in its own session [{child.pid}]", "sim.py")


def _stop_child(child: subprocess.Popen[bytes] | None) -> None:
    if child is None or child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


async def _wait_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds``; return True if a stop signal arrived first."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        return False
    return True


async def _serve(options: SimOptions, stop: asyncio.Event) -> int:
    """Bind, serve until a stop signal, shut down; return the exit code."""
    state = EngineState(options)
    if options.mode == "sglang":
        app = build_sglang_app(state)
    else:
        app = build_app(state, dev_mode_enabled(os.environ.get("VLLM_SERVER_DEV_MODE")))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    pid = os.getpid()
    logs.server_log("INFO", f"Started server process [{pid}]")
    logs.server_log("INFO", "Waiting for application startup.")
    kv = state.kv
    try:
        if kv is not None:  # like kvcached: the segment exists, at full capacity, before the port opens
            kv.create()
        # uvicorn's order: the lifespan's startup is complete (and said) before the sockets are
        # bound, so a client that can connect always finds this line in the log already
        logs.server_log("INFO", "Application startup complete.")
        try:
            await site.start()
        except OSError as exc:
            logs.server_log("ERROR", f"[Errno {exc.errno}] error while attempting to bind on address "
                            f"({options.host!r}, {options.port}): {exc.strerror}")
            await runner.cleanup()
            return 1
        if kv is not None:
            kv.start_watch()
        memory = MemoryFeed(state.memory)
        state.memory_changed = memory.flush
        reporting = asyncio.create_task(memory.run(stop))
        logs.server_log("INFO", f"Uvicorn running on http://{options.host}:{options.port} (Press CTRL+C to quit)")
        await stop.wait()
        logs.server_log("INFO", "Shutting down")
        logs.server_log("INFO", "Waiting for application shutdown.")
        await runner.cleanup()
        await reporting
        logs.server_log("INFO", "Application shutdown complete.")
        logs.server_log("INFO", f"Finished server process [{pid}]")
        return 0
    finally:
        if kv is not None:  # a clean exit removes the segment; SIGKILL or a crash leaves it behind
            await kv.stop_watch()
            kv.remove()


async def _serve_ollama(options: SimOptions, stop: asyncio.Event) -> int:
    """Bind ``OLLAMA_HOST``, serve Ollama's API until a stop signal, shut down; return the exit code."""
    state = OllamaState(options)
    runner = web.AppRunner(build_ollama_app(state), access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    try:
        try:
            await site.start()
        except OSError as exc:
            logs.ollama_log("ERROR", f"listen tcp {options.host}:{options.port}: bind: {exc.strerror}",
                            "routes.go:1236")
            print(f"Error: listen tcp {options.host}:{options.port}: bind: {exc.strerror}", file=sys.stderr,
                  flush=True)
            return 1
        logs.ollama_log("INFO", f"Listening on {options.host}:{options.port} (version {OLLAMA_SIM_VERSION})",
                        "routes.go:1306")
        memory = MemoryFeed(state.memory)
        state.memory_changed = memory.flush
        await memory.run(stop)
        await stop.wait()
        return 0
    finally:
        state.shutdown()
        await runner.cleanup()


async def _run_ollama(options: SimOptions, stop: asyncio.Event) -> int:
    settings = options.ollama
    assert settings is not None
    keep_alive = "forever" if settings.keep_alive_s == float("inf") else f"{settings.keep_alive_s:g}s"
    logs.ollama_log("INFO", f"server config env=\"map[OLLAMA_HOST:http://{options.host}:{options.port} "
                    f"OLLAMA_CONTEXT_LENGTH:{settings.context_length} OLLAMA_NUM_PARALLEL:{settings.num_parallel} "
                    f"OLLAMA_KEEP_ALIVE:{keep_alive} OLLAMA_MODELS:{settings.models_dir}]\"", "routes.go:1230")
    for warning in settings.warnings:
        logs.ollama_log("WARN", warning, "config.go:1")
    if options.ignored_args:
        logs.ollama_log("DEBUG", f"simulator ignores: {' '.join(options.ignored_args)}", "sim_engine.go:1")
    child = _spawn_child() if options.spawn_child else None
    try:
        logs.ollama_log("INFO", "looking for compatible GPUs (simulated)", "gpu.go:217")
        if options.hang_on_start:
            await stop.wait()
            return 0
        if await _wait_or_stop(stop, options.startup_seconds):
            return 0
        logs.ollama_log("INFO", f"inference compute id=GPU-sim library=cuda name=\"Simulated GPU\" "
                        f"startup={options.startup_seconds:.3f}s", "types.go:130")
        return await _serve_ollama(options, stop)
    finally:
        _stop_child(child)


async def run(options: SimOptions) -> int:
    """The whole life of the engine process."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):  # a slow shutdown takes --sim-stop-seconds
        loop.add_signal_handler(signum, loop.call_later, options.stop_seconds, stop.set)
    if options.crash_after is not None:
        delay = max(0.0, options.crash_after - (time.monotonic() - PROCESS_START))
        loop.call_later(delay, _crash, options.crash_exit_code)
    if options.mode == "ollama":
        return await _run_ollama(options, stop)
    if options.mode == "sglang":
        logs.engine_log("INFO", f"SGLang server (simulated) version {SGLANG_SIM_VERSION}: "
                        f"model_path={options.model!r}, enable_memory_saver="
                        f"{options.enable_memory_saver}", "server_args.py")
    else:
        logs.engine_log("INFO", f"vLLM API server version {SIM_VERSION}", "api_server.py")
    logs.engine_log("INFO", f"non-default args: model={options.model!r}, served_model_name="
                    f"{list(options.served_model_names)!r}, host={options.host!r}, port={options.port}, "
                    f"enable_sleep_mode={options.enable_sleep_mode}, max_model_len={options.max_model_len}",
                    "utils.py")
    if options.ignored_args:
        logs.engine_log("DEBUG", f"simulator ignores: {' '.join(options.ignored_args)}", "sim_engine.py")
    if options.model.startswith("/") and not os.path.isdir(options.model):
        # As vLLM: an absolute path that is no directory is no model (nor a Hub repo id).
        logs.engine_log("ERROR", f"Invalid repository ID or local directory specified: "
                        f"'{options.model}'.", "config.py")
        return 1
    child = _spawn_child() if options.spawn_child else None
    if options.spawn_escaped:
        _spawn_escaped()
    if options.spawn_hidden:
        _spawn_escaped(hidden=True)
    try:
        logs.engine_log("INFO", f"Loading model {options.model} (simulated, {options.memory_bytes} bytes).",
                        "gpu_model_runner.py")
        if options.hang_on_start:
            await stop.wait()  # never opens the port and never logs again
            return 0
        if await _wait_or_stop(stop, options.startup_seconds):
            return 0
        logs.engine_log("INFO", f"Model loading took {options.startup_seconds:.4f} seconds (simulated).",
                        "gpu_model_runner.py")
        logs.engine_log("INFO", f"Starting vLLM API server 0 on http://{options.host}:{options.port}",
                        "launcher.py")
        return await _serve(options, stop)
    finally:
        _stop_child(child)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the engine; return the process exit code."""
    # vLLM exposes no *_created series. The switch is process-wide, so it is flipped here, not in state.py.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    try:
        options = parse_options(sys.argv[1:] if argv is None else argv, os.environ)
    except OptionsError as exc:
        logs.server_log("ERROR", f"simulated engine: {exc}")
        return 2
    return asyncio.run(run(options))


if __name__ == "__main__":
    sys.exit(main())
