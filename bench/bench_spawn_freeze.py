"""Engine starts on a busy node: how long each start freezes the agent's event loop.

An engine is started from a worker thread (``engines.process.ProcessLauncher.spawn``), so the
event loop should keep running meanwhile. It did not while starts went through
``os.posix_spawn``: CPython holds the interpreter lock until the vfork child has exec'd, and
on a busy node that child waits for the CPU, so every start froze the loop (accepting
connections, probing, answering) for as long as its child waited. ``subprocess.Popen`` lets
go of the lock around its vfork.

The bench starts ``--busy`` processes that spin (each in its own session, as engines are),
then ``--starts`` starts of ``/bin/true`` one after another from an event loop, and a thread
that wakes every millisecond records its gaps (time it could not run Python: the lock was
held): both through the launcher and through
a bare ``os.posix_spawn`` in a worker thread (how the launcher started engines before), in
alternation.

    python -m bench.bench_spawn_freeze [--busy 30] [--starts 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import Result, log
from engines.process import ProcessLauncher


async def _bare_posix_spawn(log_path: Path) -> int:
    def spawn() -> int:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        try:
            return os.posix_spawn("/bin/true", ["/bin/true"], dict(os.environ),
                                  file_actions=[(os.POSIX_SPAWN_DUP2, fd, 1),
                                                (os.POSIX_SPAWN_DUP2, fd, 2)], setsid=True)
        finally:
            os.close(fd)

    pid = await asyncio.to_thread(spawn)
    await asyncio.to_thread(os.waitpid, pid, 0)
    return pid


async def _launcher(launcher: ProcessLauncher, log_path: Path) -> int:
    proc = await launcher.spawn(["/bin/true"], dict(os.environ), log_path)
    await proc.exited
    return proc.pid


async def _round(how: str, starts: int, tmp: Path) -> tuple[float, float]:
    """A thread's longest gap and its time lost in gaps over 5 ms, in ms, during ``starts``."""
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    launcher = ProcessLauncher(tmp)
    try:
        for i in range(starts):
            path = tmp / f"{how}-{i}.log"
            await (_launcher(launcher, path) if how == "launcher" else _bare_posix_spawn(path))
    finally:
        done.set()
        ticker.join()
    return max(gaps) * 1000, sum(g for g in gaps if g > 0.005) * 1000


def run(busy: int = 30, starts: int = 30, rounds: int = 3) -> Result:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(busy)]
    got: dict[str, list[tuple[float, float]]] = {"posix_spawn": [], "launcher": []}
    try:
        time.sleep(1)  # the spinners are running
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(rounds):
                for how in ("posix_spawn", "launcher") if r % 2 == 0 else ("launcher",
                                                                          "posix_spawn"):
                    log(f"round {r + 1}: {how}")
                    got[how].append(asyncio.run(_round(how, starts, Path(tmp))))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    lines = [f"{starts} starts one after another among {busy} spinning processes, on "
             f"{os.cpu_count()} CPUs; {rounds} rounds each, alternating", "",
             "| started through | a thread's longest gap (median, each) | its time lost in gaps > 5 "
             "ms (median, each) |", "|---|---|---|"]
    for how, figures in got.items():
        longest = ", ".join(f"{g:.1f}" for g, _ in figures)
        lost = ", ".join(f"{t:.0f}" for _, t in figures)
        lines.append(f"| {how} | {statistics.median(g for g, _ in figures):.1f} ms ({longest}) "
                     f"| {statistics.median(t for _, t in figures):.0f} ms ({lost}) |")
    ours = statistics.median(t for _, t in got["launcher"])
    bare = statistics.median(t for _, t in got["posix_spawn"])
    return Result("engine starts on a busy node", "the launcher's starts hold other threads up "
                  "at most a third as long as posix_spawn's", f"{ours:.0f} ms lost against "
                  f"{bare:.0f}", ours * 3 <= bare, details=got, lines=lines,
                  headline=("loop time lost (ms)", ours))


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--busy", type=int, default=30)
    p.add_argument("--starts", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    result = run(args.busy, args.starts, args.rounds)
    print(result.report(), flush=True)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
