"""AIBrix's runtime sidecar (``aibrix.app``, its ModelClaim runtime API) as its own process,
launching our simulated engine, for ``bench.bench_aibrix_runtime``.

AIBrix's ``SubprocessEngineLauncher.launch`` runs ``sys.executable -m
vllm.entrypoints.openai.api_server --model M --served-model-name N --host 0.0.0.0 --port P
--enable-sleep-mode [engine_config.args]`` in a new session. ``write_shim`` puts a package
``vllm.entrypoints.openai.api_server`` on the runtime's PYTHONPATH whose only code execs (same
PID) ``python -m engines.sim serve ...`` with those arguments, with our interpreter and our tree,
and without the runtime's ``PROMETHEUS_MULTIPROC_DIR`` (which would put the engine's metrics in
multiprocess mode): the engine process is then the one the floor and our agent start, plus one
bare interpreter start of the runtime's venv (``bench.bench_aibrix_runtime`` measures that cost
as a floor of its own). AIBrix's source and venv are never imported here: the runtime runs in
its own interpreter and is reached only over HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

SHIM = """\
import os, sys
env = dict(os.environ)
env.pop("PROMETHEUS_MULTIPROC_DIR", None)
env["PYTHONPATH"] = env.pop("SIM_PYTHONPATH")
python = env.pop("SIM_PYTHON")
os.execve(python, [python, "-m", "engines.sim", "serve", *sys.argv[1:]], env)
"""


def write_shim(directory: Path) -> Path:
    """The directory that holds the ``vllm.entrypoints.openai.api_server`` shim."""
    package = directory / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True, exist_ok=True)
    for level in (directory / "vllm", directory / "vllm" / "entrypoints", package):
        (level / "__init__.py").write_text("")
    (package / "api_server.py").write_text(SHIM)
    return directory


def runtime_env(tmp: Path, shim: Path) -> dict[str, str]:
    """The runtime's environment: its registry, cache markers, metrics directory and log under
    ``tmp``, the shim first on the path its engines inherit, our engine's interpreter and tree."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIBRIX_")}
    env.update({
        "PYTHONPATH": str(shim),
        "SIM_PYTHON": sys.executable, "SIM_PYTHONPATH": str(ROOT),
        "AIBRIX_ENGINE_REGISTRY_PATH": str(tmp / "engines.json"),
        "AIBRIX_WEIGHT_CACHE_DIR": str(tmp / "cache"),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp / "prometheus"),
        "LOG_PATH": str(tmp / "aibrix-python.log"),
    })
    return env


def runtime_argv(python: str, src: Path, port: int) -> list[str]:
    """``aibrix_runtime`` (``aibrix.app:main``: uvicorn on FastAPI) from the source tree ``src``
    (the directory that holds the ``aibrix`` package)."""
    boot = (f"import sys; sys.path.insert(0, {str(src)!r}); sys.argv[0] = 'aibrix_runtime'; "
            "from aibrix.app import main; main()")
    return [python, "-c", boot, "--host", "127.0.0.1", "--port", str(port)]


def call(port: int, path: str, body: dict[str, Any] | None = None,
         timeout_s: float = 60.0) -> tuple[int, Any]:
    """One HTTP request to the runtime: (status, parsed JSON); (0, error text) if unreachable."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def activation(name: str, port: int, args: dict[str, str]) -> dict[str, Any]:
    """The body of ``POST /v1/runtime/models/activate`` for one simulated engine."""
    return {"model_name": name, "artifact_url": "bench/w", "engine": "vllm", "port": port,
            "engine_config": {"args": args}}


class Runtime:
    """One AIBrix runtime process; ``kill`` SIGKILLs it alone (its engines have their own
    sessions and live on), ``close`` also stops every engine its registry names and removes
    their /dev/shm segments."""

    def __init__(self, python: str, src: Path, tmp: Path, env: dict[str, str], port: int) -> None:
        self.port, self.tmp, self.env = port, tmp, env
        self.argv = runtime_argv(python, src, port)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> float:
        """Popen, then poll ``/healthz`` every 5 ms: seconds from just before Popen to its 200."""
        out = (self.tmp / "aibrix-runtime.log").open("ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, cwd=self.tmp, env=self.env, stdout=out,
                                     stderr=out, start_new_session=True)
        out.close()
        while call(self.port, "/healthz", timeout_s=5)[0] != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"AIBrix's runtime exited ({self.proc.returncode}); see "
                                   f"{self.tmp / 'aibrix-runtime.log'}")
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError("AIBrix's runtime did not answer /healthz")
            time.sleep(0.005)
        return time.perf_counter() - t0

    def models(self) -> list[dict[str, Any]]:
        status, body = call(self.port, "/v1/runtime/models")
        if status != 200:
            raise RuntimeError(f"GET /v1/runtime/models: {status} {body}")
        return list(body["models"])

    def registry(self) -> list[dict[str, Any]]:
        """The engine records AIBrix persisted (``EngineRegistry``: PIDs and start times)."""
        path = Path(self.env["AIBRIX_ENGINE_REGISTRY_PATH"])
        if not path.exists():
            return []
        data = json.loads(path.read_text())
        return list(data["engines"] if isinstance(data, dict) else data)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        for record in self.registry():
            with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
                os.killpg(int(record["pid"]), signal.SIGKILL)
            # the simulated engine's kvcached segment (a SIGKILLed engine leaves it behind)
            with contextlib.suppress(OSError):
                (Path("/dev/shm") / Path(str(record["ipc_name"])).name).unlink()
        path = Path(self.env["AIBRIX_ENGINE_REGISTRY_PATH"])
        path.unlink(missing_ok=True)
