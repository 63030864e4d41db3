"""An engine stand-in that breaks HTTP on request: a raw-socket asyncio server, run as a process.

Each ``POST`` names the answer it wants in its JSON body (``"shape": NAME``, one of ``SHAPES``
or ``CONTROL_SHAPES``), and gets those bytes exactly as written here, with the connection then
kept, closed, left silent, or fed without end. A ``GET`` (the agent's ``/health``, ``/metrics``:
paths it cannot choose), or a ``POST`` that names no shape (the door's ``/tokenize``), gets the
shape last named by ``{"shape": "gets", "as": NAME}``. After a broken answer the connection is marked spent: a request that still comes on it
(the door pooled a connection it should have dropped) is recorded, and ``"shape": "report"``
answers what was recorded (``{"reused": [...], "answers": N}``).

    python -m tests.malformed_engine [--port P]   # prints "PORT <n>" once it listens
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

JSON = b'{"id":"cmpl-1","object":"chat.completion","choices":[]}'
EVENT = b'data: {"id":"cmpl-1","choices":[{"delta":{"content":"hi"}}]}\n\n'


def _head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _json(*headers: str, body: bytes = JSON) -> bytes:
    return _head("HTTP/1.1 200 OK", "Content-Type: application/json", *headers) + body


SSE_HEAD = _head("HTTP/1.1 200 OK", "Content-Type: text/event-stream",
                 "Transfer-Encoding: chunked")
FIRST = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)


@dataclass(frozen=True)
class Shape:
    data: bytes
    then: str = "keep"  # keep (wait for the next request), close, stall (silent, open),
    # endless (FILL sent for ever, raw or as chunks), trickle (one byte a TRICKLE_S)
    door: str = "502"  # what the door's client must get: 502, 504, 200, stream-error


SHAPES: dict[str, Shape] = {
    "ok": Shape(_json(f"Content-Length: {len(JSON)}"), door="200"),
    "negative_length": Shape(_json("Content-Length: -5")),
    "signed_length": Shape(_json(f"Content-Length: +{len(JSON)}")),
    "overflow_length": Shape(_json("Content-Length: 99999999999999999999999")),
    "huge_length": Shape(_json("Content-Length: 18446744073709551615")),
    "huge_length_close": Shape(_json("Content-Length: 1000000000"), "close"),
    "two_lengths": Shape(_json(f"Content-Length: {len(JSON)}", "Content-Length: 2")),
    "length_list": Shape(_json(f"Content-Length: {len(JSON)}, {len(JSON)}")),
    "length_and_chunked": Shape(_json(f"Content-Length: {len(JSON)}",
                                      "Transfer-Encoding: chunked")),
    "negative_chunk": Shape(_json("Transfer-Encoding: chunked", body=b"-5\r\nhello\r\n0\r\n\r\n")),
    "huge_chunk": Shape(_json("Transfer-Encoding: chunked",
                              body=b"fffffffffffffffffffff\r\nhello\r\n0\r\n\r\n")),
    "nonhex_chunk": Shape(_json("Transfer-Encoding: chunked", body=b"5z\r\nhello\r\n0\r\n\r\n")),
    "chunk_without_crlf": Shape(_json("Transfer-Encoding: chunked",
                                      body=b"5\r\nhelloX0\r\n\r\n")),
    "bad_header_name": Shape(_json("Bad Name: x", f"Content-Length: {len(JSON)}")),
    "colon_in_name": Shape(_json("X-A : x", f"Content-Length: {len(JSON)}")),
    "nul_in_value": Shape(_json("X-Request-Id: a\x00b", f"Content-Length: {len(JSON)}")),
    "cr_in_value": Shape(_json("X-Request-Id: a\rSet-Cookie: x", f"Content-Length: {len(JSON)}")),
    "folded_header": Shape(_json("X-Request-Id: a", " b", f"Content-Length: {len(JSON)}")),
    "no_status_line": Shape(_head("Content-Type: application/json",
                                  f"Content-Length: {len(JSON)}") + JSON),
    "garbage": Shape(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)), "close"),
    "http2_version": Shape(_head("HTTP/2 200", f"Content-Length: {len(JSON)}") + JSON),
    "rtsp": Shape(_head("RTSP/1.0 200 OK", f"Content-Length: {len(JSON)}") + JSON),
    "status_999": Shape(_head("HTTP/1.1 999 Odd", f"Content-Length: {len(JSON)}") + JSON),
    "switch_protocols": Shape(_head("HTTP/1.1 101 Switching Protocols", "Upgrade: websocket",
                                    "Connection: upgrade") + b"\x81\x05hello"),
    "endless_head": Shape(_head("HTTP/1.1 200 OK", *(f"X-Pad-{i}: {'p' * 100}"
                                                     for i in range(1000))), "stall"),
    "close_mid_body": Shape(_json(f"Content-Length: {len(JSON) + 50}"), "close"),
    "stall_head": Shape(b"", "stall", "504"),
    "stall_body": Shape(_json(f"Content-Length: {len(JSON) + 50}"), "stall", "504"),
    "bytes_after": Shape(_json(f"Content-Length: {len(JSON)}") + b"HTTP/1.1 200 OK\r\n\r\n",
                         door="200"),
    "hop_by_hop": Shape(_json("Connection: keep-alive, X-Secret", "Keep-Alive: timeout=5",
                              "Proxy-Connection: keep-alive", "Upgrade: h2c", "TE: trailers",
                              "Trailer: X-T", "Set-Cookie: a=b", "X-Secret: s",
                              "X-Request-Id: r-1", "Cache-Control: no-store",
                              f"Content-Length: {len(JSON)}"), door="200"),
    "close_mid_stream": Shape(SSE_HEAD + FIRST, "close", "stream-error"),
    "bad_chunk_mid_stream": Shape(SSE_HEAD + FIRST + b"-5\r\nhello\r\n", "keep", "stream-error"),
    "stall_stream": Shape(SSE_HEAD + FIRST, "stall", "stream-timeout"),
}


# What the door's test leaves out (its reads are bounded by the upstream timeout, not a deadline):
# the agent's control calls' own hostile answers.
CONTROL_SHAPES: dict[str, Shape] = {
    "endless_body": Shape(_head("HTTP/1.1 200 OK", "Content-Type: text/plain"), "endless"),
    "endless_chunks": Shape(_head("HTTP/1.1 200 OK", "Content-Type: text/plain",
                                  "Transfer-Encoding: chunked"), "endless"),
    "trickle": Shape(_json("Content-Length: 100000000", body=b""), "trickle", "504"),
    "unknown_charset": Shape(_head("HTTP/1.1 200 OK",
                                   "Content-Type: application/json; charset=no-such-codec",
                                   f"Content-Length: {len(JSON)}") + JSON, door="200"),
}
ALL_SHAPES = SHAPES | CONTROL_SHAPES
FILL = b"x" * (1 << 16)
TRICKLE_S = 0.05


async def _endless(writer: asyncio.StreamWriter, chunked: bool) -> None:
    piece = b"%x\r\n%b\r\n" % (len(FILL), FILL) if chunked else FILL
    while True:  # until the peer gives up and the write fails
        writer.write(piece)
        await writer.drain()


async def _trickle(writer: asyncio.StreamWriter) -> None:
    while True:
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(TRICKLE_S)


class Engine:
    def __init__(self) -> None:
        self.reused: list[str] = []
        self.answers = 0
        self.gets = "ok"  # the shape of a request that names none

    async def connection(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        spent: str | None = None  # the broken answer this connection carried
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    field, _, value = line.partition(b":")
                    if field.strip().lower() == b"content-length":
                        length = int(value)
                doc = json.loads(await reader.readexactly(length) or b"{}")
                name = self.gets if head.startswith(b"GET ") else str(doc.get("shape", self.gets))
                if spent is not None:
                    self.reused.append(spent)
                self.answers += 1
                if name == "report":
                    body = json.dumps({"reused": self.reused, "answers": self.answers}).encode()
                    writer.write(_json(f"Content-Length: {len(body)}", body=body))
                    continue
                if name == "gets":
                    self.gets = str(doc["as"])
                    name = "ok"
                shape = ALL_SHAPES[name]
                writer.write(shape.data)
                await writer.drain()
                if shape.door != "200" or name == "bytes_after":
                    spent = name
                if shape.then == "close":
                    break
                if shape.then == "stall":
                    await reader.read()  # silent until the peer closes
                    break
                if shape.then == "endless":
                    await _endless(writer, b"chunked" in shape.data)
                if shape.then == "trickle":
                    await _trickle(writer)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, KeyError):
            pass
        finally:
            writer.close()


def spawn(argv: list[str], log: Path, pipe: bool = False) -> subprocess.Popen[bytes]:
    """``python argv`` in its own process group, its output in ``log`` (``pipe``: read by the
    test instead, only for a process that writes one line, as this one's "PORT n")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIM_")}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE if pipe else out, stderr=out,
                                start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill the process group ``spawn`` started, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


async def main(port: int) -> None:
    engine = Engine()
    server = await asyncio.start_server(engine.connection, "127.0.0.1", port)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    try:
        asyncio.run(main(parser.parse_args().port))
    except KeyboardInterrupt:
        sys.exit(0)
