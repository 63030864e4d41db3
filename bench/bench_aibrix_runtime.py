"""Issue 26's start-up figures for AIBrix's runtime beside our agent, in one run, against the same
simulated engine (``bench.aibrix_runtime`` says how AIBrix's launcher is made to start it).

AIBrix's runtime runs as its own process (``aibrix.app:main``, uvicorn on FastAPI, as its
``aibrix_runtime`` script does) from a source tree and a venv of its own; it is reached only
over HTTP. Figures, each with ours measured in the same run by the existing bench modules:

* (a) process start to an answering API (``bench.bench_start.start_to_answer``, the floor there
  too): AIBrix's ``/healthz``, and its first ``/v1/runtime/models`` (that first call is what
  builds its ``ModelRuntime``: registry read, supervisor thread started);
* (b) re-adoption of ``--adopt`` engines after a SIGKILL of the runtime: process start until its
  ``/v1/runtime/models`` lists every engine active and ready, none restarted (PIDs from its
  registry); ours is ``bench.bench_readoption``;
* (c) ``--engines`` engines activated together (one thread each) and one after another: from the
  first call until every engine answers ``/health`` (probed by this bench, as the floor is) and
  until AIBrix itself lists all of them active; ours is ``bench.bench_mass_start.agent_run``
  (declared footprints, ``--gpus`` cards) and its floor;
* (d) idle CPU with those engines over ``--seconds`` after ``--settle`` (``bench.bench_idle``'s
  windows: the runtime's CPU, the engines' CPU while it runs and while it is SIGSTOPped);
* (e) RSS with no engine (from (a)).

    python -m bench.bench_aibrix_runtime --aibrix-src /tmp/aibrix-src/python/aibrix \\
        --python /tmp/aibrix-venv/bin/python [--engines 64] [--adopt 32] [--repeats 3]

Exits 0 printing ``skipped: <why>`` if the source or the venv is absent. Never part of the tests.
"""

from __future__ import annotations

import argparse
import compileall
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from bench import bench_idle, bench_readoption
from bench.aibrix_runtime import ROOT, Runtime, activation, call, runtime_argv, runtime_env, write_shim
from bench.bench_mass_start import _answers, agent_run, flags
from bench.bench_mass_start import floor as mass_floor
from bench.bench_start import FLOOR, PACKAGES, agent_argv, start_to_answer
from bench.common import log, session
from bench.sidebyside import BASE
from tests.harness import free_port, free_port_block

MiB = 2**20


def engine_args(startup_s: float) -> dict[str, str]:
    """The floor's engine flags (``bench.sidebyside.engine_argv``), as AIBrix's engine_config."""
    return {**BASE, **flags(startup_s), "--disable-uvicorn-access-log": ""}


def skip_reason(src: Path, python: Path) -> str | None:
    if not (src / "aibrix" / "runtime" / "model_runtime.py").is_file():
        return f"no AIBrix source at {src} (aibrix/runtime/model_runtime.py missing)"
    if not os.access(python, os.X_OK):
        return f"no AIBrix venv interpreter at {python}"
    probe = subprocess.run([str(python), "-c", "import fastapi, uvicorn, httpx, structlog, "
                            "pydantic_settings, boto3"], capture_output=True)
    if probe.returncode:
        return f"{python} lacks AIBrix's runtime dependencies: {probe.stderr.decode()[-200:]}"
    return None


# ---- (a) and (e): process start to an answering API, RSS with no engine ---------------------


def starts(python: str, src: Path, tmp: Path, env: dict[str, str], repeats: int
           ) -> dict[str, list[tuple[float, float, int]]]:
    """(seconds, CPU seconds by then, settled RSS) per start, interleaved in a palindrome."""
    ours_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out: dict[str, list[tuple[float, float, int]]] = {
        "floor": [], "ours": [], "aibrix /healthz": [], "aibrix /v1/runtime/models": []}
    for i in range(repeats):
        order = list(out) if i % 2 == 0 else list(reversed(out))
        for who in order:
            port = free_port()
            if who == "floor":
                r = start_to_answer([sys.executable, "-c", FLOOR, str(port)], port, "/", ours_env)
            elif who == "ours":
                r = start_to_answer(agent_argv(port, tmp / f"start{i}"), port, "/healthz",
                                    ours_env)
            else:
                path = who.split(" ", 1)[1]
                (tmp / "engines.json").unlink(missing_ok=True)
                r = start_to_answer(runtime_argv(python, src, port), port, path, env)
            out[who].append((r[0], r[1], r[3]))
        log(f"start {i + 1}/{repeats}: " + ", ".join(f"{k} {v[-1][0] * 1000:.0f} ms"
                                                     for k, v in out.items()))
    return out


# ---- AIBrix: mass start, re-adoption, idle ------------------------------------------------


def until_health(ports: list[int], t0: float, timeout_s: float = 300) -> float:
    pending = set(ports)
    while pending:
        pending = {p for p in pending if not _answers(p)}
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{len(pending)} AIBrix-started engines never answered /health")
        if pending:
            time.sleep(0.02)
    return time.monotonic() - t0


def until_listed(rt: Runtime, count: int, t0: float, timeout_s: float = 300) -> float:
    """Until the runtime's own list shows ``count`` models active and ready."""
    while True:
        status, body = call(rt.port, "/v1/runtime/models", timeout_s=30)
        models = body["models"] if status == 200 else []
        if len(models) == count and all(m["phase"] == "active" and m["ready"] for m in models):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"AIBrix's runtime never listed {count} models active")
        time.sleep(0.005 if status == 0 else 0.05)


def shim_floor(python: str, env: dict[str, str], engines: int, startup_s: float) -> float:
    """The floor with each engine started as AIBrix's launcher starts it (its interpreter, the
    shim's exec): what launching through the shim costs by itself."""
    base = free_port_block(engines)
    flat = [x for k, v in engine_args(startup_s).items() for x in ((k, v) if v else (k,))]
    procs = []
    t0 = time.monotonic()
    try:
        for i in range(engines):
            procs.append(subprocess.Popen(
                [python, "-m", "vllm.entrypoints.openai.api_server", "--model", "bench/w",
                 "--served-model-name", "w", "--host", "127.0.0.1", "--port", str(base + i),
                 "--enable-sleep-mode", *flat], env=env, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True))
        return until_health([base + i for i in range(engines)], t0)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def aibrix_mass(rt: Runtime, engines: int, startup_s: float, together: bool) -> dict[str, Any]:
    base = free_port_block(engines)
    ports = [base + i for i in range(engines)]
    args = engine_args(startup_s)

    def activate(i: int) -> float:
        sent = time.perf_counter()
        status, body = call(rt.port, "/v1/runtime/models/activate",
                            activation(f"mass-{i:02d}", ports[i], args), timeout_s=120)
        if status != 200:
            raise RuntimeError(f"activate mass-{i:02d}: {status} {body}")
        return time.perf_counter() - sent

    t0 = time.monotonic()
    if together:
        with ThreadPoolExecutor(max_workers=engines) as pool:
            calls = list(pool.map(activate, range(engines)))
    else:
        calls = [activate(i) for i in range(engines)]
    answered = time.monotonic() - t0
    health = until_health(ports, t0)
    listed = until_listed(rt, engines, t0)
    return {"health_s": health, "listed_s": listed, "answered_s": answered,
            "call_p50_ms": statistics.median(calls) * 1000, "call_max_ms": max(calls) * 1000}


def aibrix_idle(rt: Runtime, settle_s: float, seconds: float) -> dict[str, float]:
    assert rt.proc is not None
    me = psutil.Process(rt.proc.pid)
    procs = [psutil.Process(int(r["pid"])) for r in rt.registry()]
    time.sleep(settle_s)
    runtime_pct, probed = bench_idle.window(seconds, me, procs)
    os.kill(me.pid, signal.SIGSTOP)
    try:
        _, unprobed = bench_idle.window(seconds, None, procs)
    finally:
        os.kill(me.pid, signal.SIGCONT)
    return {"runtime_pct": runtime_pct, "answering_pct": probed - unprobed,
            "rss": me.memory_info().rss, "threads": me.num_threads()}


def aibrix_readoption(rt: Runtime, engines: int, startup_s: float) -> dict[str, Any]:
    aibrix_mass(rt, engines, startup_s, together=True)
    before = {r["model_name"]: r["pid"] for r in rt.registry()}
    rt.kill()
    t0 = time.monotonic()
    rt.start()
    ready = until_listed(rt, engines, t0)
    after = {r["model_name"]: r["pid"] for r in rt.registry()}
    changed = [m for m in before if after.get(m) != before[m]]
    restarts = sum(int(r.get("restart_count", 0)) for r in rt.registry())
    return {"all_ready_s": ready, "changed": changed, "restarts": restarts}


# ---- the run --------------------------------------------------------------------------------


def ratio(theirs: float, ours: float) -> str:
    return f"{theirs / ours:.2f}x" if ours > 0 else "n/a"


def run(src: Path, python: str, engines: int, adopt: int, repeats: int, gpus: str,
        startup_s: float, settle_s: float, seconds: float) -> list[str]:
    rows: list[tuple[str, str, str, str]] = []  # figure, ours, AIBrix, AIBrix / ours
    # Both trees byte-compiled, as installed packages are (``bench.bench_start`` says why); the
    # AIBrix tree with its own interpreter (its venv's packages were compiled by pip).
    for package in PACKAGES:
        compileall.compile_dir(str(ROOT / package), quiet=1)
    subprocess.run([python, "-m", "compileall", "-q", str(src / "aibrix")], check=True,
                   stdout=subprocess.DEVNULL)
    with session("aibrix") as s:
        shim = write_shim(s.tmp / "shim")
        env = runtime_env(s.tmp, shim)
        st = starts(python, src, s.tmp, env, repeats)
        med = {k: statistics.median(x[0] for x in v) for k, v in st.items()}
        rss = {k: statistics.median(x[2] for x in v) for k, v in st.items()}
        cpu = {k: statistics.median(x[1] for x in v) for k, v in st.items()}
        rows += [
            ("(a) floor: bare interpreter + aiohttp/pydantic/psutil/prometheus answering GET",
             f"{med['floor'] * 1000:.0f} ms", "", ""),
            ("(a) process start to an answering API (ours /healthz; AIBrix /healthz)",
             f"{med['ours'] * 1000:.0f} ms", f"{med['aibrix /healthz'] * 1000:.0f} ms",
             ratio(med["aibrix /healthz"], med["ours"])),
            ("(a) the same, AIBrix's first /v1/runtime/models (builds its ModelRuntime)", "",
             f"{med['aibrix /v1/runtime/models'] * 1000:.0f} ms",
             ratio(med["aibrix /v1/runtime/models"], med["ours"])),
            ("(a) CPU spent by then", f"{cpu['ours'] * 1000:.0f} ms",
             f"{cpu['aibrix /healthz'] * 1000:.0f} ms", ratio(cpu["aibrix /healthz"], cpu["ours"])),
            ("(e) RSS, answered and settled, no engine (floor "
             f"{rss['floor'] / MiB:.1f} MiB)", f"{rss['ours'] / MiB:.1f} MiB",
             f"{rss['aibrix /healthz'] / MiB:.1f} MiB",
             ratio(rss["aibrix /healthz"], rss["ours"]))]

        log(f"floor: {engines} engines at once, ours and through the shim")
        floors = [mass_floor(engines, startup_s, s.tmp)]
        shimmed = shim_floor(python, env, engines, startup_s)
        results: dict[str, dict[str, Any]] = {}
        for together in (True, False):
            how = "together" if together else "one after another"
            log(f"ours: {engines} activations {how}")
            results[f"ours {how}"] = agent_run(s, engines, gpus, startup_s, True, together, ROOT)
            log(f"AIBrix: {engines} activations {how}")
            rt = Runtime(python, src, s.tmp, env, free_port())
            try:
                rt.start()
                # built before the activations arrive, as a controller's first snapshot would:
                # get_model_runtime() builds its singleton unguarded, on the first call
                rt.models()
                results[f"aibrix {how}"] = aibrix_mass(rt, engines, startup_s, together)
                if together:
                    log(f"AIBrix: idle with {engines} engines")
                    idle = aibrix_idle(rt, settle_s, seconds)
            finally:
                rt.close()
        floors.append(mass_floor(engines, startup_s, s.tmp))
        base = statistics.mean(floors)
        rows.append((f"(c) floor: {engines} engine processes at once until each answers /health",
                     f"{base:.2f} s", f"{shimmed:.2f} s (through the shim)",
                     ratio(shimmed, base)))
        for how in ("together", "one after another"):
            o, a = results[f"ours {how}"], results[f"aibrix {how}"]
            rows.append((f"(c) {engines} activations {how}: all answer /health (AIBrix; ours: "
                         f"all active on {gpus}, declared footprints)",
                         f"{o['all_active_s']:.2f} s ({o['all_active_s'] / base:.2f}x floor)",
                         f"{a['health_s']:.2f} s ({a['health_s'] / base:.2f}x floor)",
                         ratio(a["health_s"], o["all_active_s"])))
            rows.append((f"(c) the same, until AIBrix lists all active and ready", "",
                         f"{a['listed_s']:.2f} s", ratio(a["listed_s"], o["all_active_s"])))
            rows.append((f"(c) activation calls {how}: all answered; call p50 / max",
                         f"{o['answered_s']:.2f} s; {o['call_p50_ms']:.0f} / "
                         f"{o['call_max_ms']:.0f} ms",
                         f"{a['answered_s']:.2f} s; {a['call_p50_ms']:.0f} / "
                         f"{a['call_max_ms']:.0f} ms", ""))

        log(f"ours: idle with {engines} engines")
        ours_idle = bench_idle.run(engines, gpus, settle_s, seconds).details
        rows.append((f"(d) idle CPU with {engines} engines over {seconds:g} s, % of a core",
                     f"{ours_idle['agent_pct']:.2f}", f"{idle['runtime_pct']:.2f}",
                     ratio(idle["runtime_pct"], ours_idle["agent_pct"])))
        rows.append(("(d) engines' CPU answering the supervisor (probed - unprobed), % of a core",
                     f"{ours_idle['answering_pct']:.2f}", f"{idle['answering_pct']:.2f}",
                     ratio(idle["answering_pct"], ours_idle["answering_pct"])))
        rows.append((f"(d) RSS with {engines} engines", f"{ours_idle['rss_bytes'] / MiB:.1f} MiB",
                     f"{idle['rss'] / MiB:.1f} MiB ({idle['threads']} threads)",
                     ratio(idle["rss"], ours_idle["rss_bytes"])))

        log(f"ours: re-adopt {adopt} engines after SIGKILL")
        ours_adopt = bench_readoption.run(adopt).details
        log(f"AIBrix: re-adopt {adopt} engines after SIGKILL")
        rt = Runtime(python, src, s.tmp, env, free_port())
        try:
            rt.start()
            theirs = aibrix_readoption(rt, adopt, startup_s)
        finally:
            rt.close()
        rows.append((f"(b) re-adopt {adopt} engines after SIGKILL: process start to all ready",
                     f"{ours_adopt['all_ready_s'] * 1000:.0f} ms ({ours_adopt['restarts']} "
                     f"restarted)", f"{theirs['all_ready_s'] * 1000:.0f} ms ("
                     f"{theirs['restarts']} restarted, {len(theirs['changed'])} PIDs changed)",
                     ratio(theirs["all_ready_s"], ours_adopt["all_ready_s"])))
    load = os.getloadavg()
    return [f"`python -m bench.bench_aibrix_runtime --aibrix-src {src} --python {python} "
            f"--engines {engines} --adopt {adopt} --repeats {repeats}`; floors {floors[0]:.2f} s "
            f"before, {floors[1]:.2f} s after; 1-min load {load[0]:.1f} on {os.cpu_count()} "
            "cores; ratio: AIBrix's over ours (above 1: AIBrix slower or larger)", "",
            "| figure | ours | AIBrix's runtime | AIBrix / ours |", "|---|---|---|---|",
            *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)]


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--aibrix-src", type=Path, default=Path("/tmp/aibrix-src/python/aibrix"))
    p.add_argument("--python", type=Path, default=Path("/tmp/aibrix-venv/bin/python"))
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--adopt", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpus", default="8x80GiB")
    p.add_argument("--startup", type=float, default=0.5)
    p.add_argument("--settle", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=20.0)
    a = p.parse_args()
    why = skip_reason(a.aibrix_src, a.python)
    if why is not None:
        print(f"skipped: {why}", flush=True)
        return 0
    lines = run(a.aibrix_src.resolve(), str(a.python), a.engines, a.adopt, a.repeats, a.gpus,
                a.startup, a.settle, a.seconds)
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
