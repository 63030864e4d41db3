"""Secure by default, checked on the real command lines: without a token, ``serve`` and
``reconcile`` listen on loopback only, another address takes ``--insecure-no-auth``, and a keys
or token file that cannot be used stops the start in one line before anything listens."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.harness import free_port
from tests.test_operator_startup import ROOT, one_line, serve, untouched

pytestmark = pytest.mark.timeout(90)


def other_local_addresses() -> list[str]:
    """This machine's IPv4 addresses that are not loopback."""
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


@contextlib.contextmanager
def running(argv: list[str], port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` started in a session of its own, once ``/healthz`` answers on 127.0.0.1:port;
    its whole process group is killed after."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=out, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).close()
                break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def listening(proc: subprocess.Popen[bytes]) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(proc.pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


def refused_at(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def serve_argv(tmp_path: Path, port: int, *extra: str) -> list[str]:
    (tmp_path / "shm").mkdir(exist_ok=True)
    return [sys.executable, "-m", "runtime_agent.cli", "serve", "--port", str(port),
            "--state-dir", str(tmp_path / "state"), "--engines", "sim",
            "--kv-shm-dir", str(tmp_path / "shm"), "--log-format", "text", *extra]


def test_serve_without_a_token_on_every_address_is_exit_2_saying_what_to_do(
        tmp_path: Path) -> None:
    line = one_line(serve(tmp_path, "--host", "0.0.0.0"), 2, "--host 0.0.0.0", "--token-file",
                    "--insecure-no-auth", "127.0.0.1")
    assert line.startswith("runtime-agent serve: ")
    untouched(tmp_path / "state")


def test_serve_without_a_token_or_a_host_listens_on_loopback_only(tmp_path: Path) -> None:
    port = free_port()
    with running(serve_argv(tmp_path, port), port, tmp_path / "log") as proc:
        assert listening(proc) == {("127.0.0.1", port)}
        for address in other_local_addresses():  # where the machine has one
            assert refused_at(address, port), address


def test_the_insecure_flag_listens_everywhere_and_says_so_loudly(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "log"
    with running(serve_argv(tmp_path, port, "--insecure-no-auth"), port, log) as proc:
        assert ("0.0.0.0", port) in listening(proc)
        for address in other_local_addresses():
            assert not refused_at(address, port), address
    assert "WARNING" in log.read_text() and "INSECURE (--insecure-no-auth)" in log.read_text()


def test_serve_with_a_token_listens_on_every_address_by_default(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("a-long-node-token-1\n")
    port = free_port()
    with running(serve_argv(tmp_path, port, "--token-file", str(tmp_path / "token")), port,
                 tmp_path / "log") as proc:
        assert ("0.0.0.0", port) in listening(proc)
    assert "INSECURE" not in (tmp_path / "log").read_text()


def reconcile(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    claims = tmp_path / "claims"
    claims.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "runtime_agent.cli", "reconcile", "--claims", str(claims),
            "--state-dir", str(tmp_path / "rstate"), "--port", str(free_port()), *extra]
    env = {k: v for k, v in os.environ.items() if "TOKEN" not in k}
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=45, env=env)


def test_reconcile_without_a_token_on_every_address_is_exit_2(tmp_path: Path) -> None:
    one_line(reconcile(tmp_path, "--host", "0.0.0.0"), 2, "--host 0.0.0.0",
             "--insecure-no-auth")


def test_reconcile_without_a_token_or_a_host_listens_on_loopback_only(tmp_path: Path) -> None:
    (tmp_path / "claims").mkdir()
    port = free_port()
    argv = [sys.executable, "-m", "runtime_agent.cli", "reconcile", "--claims",
            str(tmp_path / "claims"), "--state-dir", str(tmp_path / "rstate"), "--port",
            str(port)]
    with running(argv, port, tmp_path / "log") as proc:
        assert listening(proc) == {("127.0.0.1", port)}


@pytest.mark.parametrize("content, words", [
    ("sk-good-key-0001\nshort\n", ("line 2", "at least 8")),
    ("sk-same-key-0001\nsk-same-key-0001 m\n", ("line 2", "listed twice"))])
def test_a_bad_door_keys_file_stops_serve_in_one_line_before_anything_listens(
        tmp_path: Path, content: str, words: tuple[str, ...]) -> None:
    keys = tmp_path / "keys"
    keys.write_text(content)
    (tmp_path / "claims").mkdir()
    door_port = free_port()
    out = serve(tmp_path, "--claims", str(tmp_path / "claims"), "--claims-port",
                str(free_port()), "--door-port", str(door_port), "--door-api-keys", str(keys))
    line = one_line(out, 7, "--door-api-keys", str(keys), *words)
    assert "listening" not in line and "endpoint on" not in line
    untouched(tmp_path / "state")


def test_a_bad_door_keys_file_stops_reconcile_in_one_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("short\n")
    one_line(reconcile(tmp_path, "--door-port", str(free_port()), "--door-api-keys", str(keys)),
             7, str(keys), "line 1")


@pytest.mark.parametrize("content, words", [("", "is empty"), ("a b\n", "one word")])
def test_a_bad_token_file_stops_reconcile_in_one_line(tmp_path: Path, content: str,
                                                      words: str) -> None:
    token = tmp_path / "token"
    token.write_text(content)
    one_line(reconcile(tmp_path, "--token-file", str(token)), 7, "--token-file", words)
