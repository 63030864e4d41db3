"""The client commands of ``runtime-agent``: snapshot, activate, sleep, wake, kv-limit, logs...

Each talks to a running agent's API (``--url``, or ``RUNTIME_AGENT_URL``) with its bearer token
(``--token-file``, ``RUNTIME_AGENT_TOKEN_FILE`` or ``RUNTIME_AGENT_TOKEN``) and says what went
wrong in one line: the agent's own refusal, an address that is the reconciler's rather than the
agent's, an agent that cannot be reached. Exit codes: 0 done, 1 the agent refused or the
operation did not succeed, 2 a flag is wrong, 7 the token file cannot be read, 8 the agent
cannot be reached (README, "Exit codes").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from contract.endpoints import AGENT_PORT, RECONCILER_PORT, base_url
from contract.quantity import size_type
from contract.flags import known_flags
from agent_client import (
    AgentUnreachable,
    HttpAgentClient,
    NotTheApi,
    Refusal,
    client_token,
    ok_body,
)
from guard.tokens import TokenError
from runtime_agent.console.output import add_output_flag, render
from runtime_agent.console.results import result_line
from runtime_agent.console.tables import snapshot_table
from runtime_agent.preflight import EXIT_UNREADABLE

EXIT_REFUSED = 1
EXIT_UNREACHABLE = 8
DRAIN_WAIT_S = 570.0  # wait-drained: deploy/warm-runtime-pool.yaml's grace of 600 s less 30
DRAIN_POLL_S = 1.0
DEFAULT_AGENT_URL = f"http://127.0.0.1:{AGENT_PORT}"
DEFAULT_RECONCILER_URL = f"http://127.0.0.1:{RECONCILER_PORT}"
MUTATING = ("activate", "deactivate", "sleep", "wake", "kv-limit")
OPERATION_ID_HELP = "a retry with the same id returns the first result (default: a new id)"
CALL_TIMEOUT_S = 30.0  # a call that does not wait for an engine
ENGINE_TIMEOUT_S = 330.0  # activate, sleep, wake, stop: the agent answers when the engine has



def url_type(text: str) -> str:
    try:
        return base_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_agent_options(parser: argparse.ArgumentParser) -> None:
    """``--url`` and ``--token-file``, with their environment variables."""
    parser.add_argument("--url", type=url_type,
                        default=os.environ.get("RUNTIME_AGENT_URL", DEFAULT_AGENT_URL),
                        help="the agent's address: http://HOST:PORT, HOST:PORT or :PORT "
                        "(env RUNTIME_AGENT_URL; default %(default)s)")
    parser.add_argument("--token-file", default=os.environ.get("RUNTIME_AGENT_TOKEN_FILE"),
                        help="a file holding the agent's bearer token (env "
                        "RUNTIME_AGENT_TOKEN_FILE; or the token itself in RUNTIME_AGENT_TOKEN; default: "
                        "no token)")


def add_commands(sub: Any) -> None:
    def command(name: str, help_text: str, description: str | None = None
                ) -> argparse.ArgumentParser:
        c: argparse.ArgumentParser = sub.add_parser(name, help=help_text,
                                                    description=description or help_text)
        add_agent_options(c)
        c.set_defaults(func=run_command)
        return c

    c = command("snapshot", "the engines, their figures and the cards, as a table",
                "The agent's snapshot: one line per engine, the GPUs, and what the marks mean. "
                "Every column is described in docs/fields.md.")
    add_output_flag(c)
    c = command("activate", "start an engine for a model",
                "Start an engine for MODEL. The same spec again changes nothing; a failed "
                "engine activated again with its spec restarts with a fresh restart budget; a "
                "different spec is refused (deactivate it first).")
    c.add_argument("model", help="the model name clients will ask for")
    c.add_argument("--artifact", required=True,
                   help="huggingface://ORG/NAME, hf://ORG/NAME, s3://..., file:///PATH or, for "
                   "Ollama, ollama://NAME:TAG")
    c.add_argument("--engine", default="vllm", choices=("vllm", "sglang", "ollama", "sim"),
                   help="the engine kind (default %(default)s)")
    c.add_argument("--engine-port", type=int, default=0,
                   help="the engine's port (default 0: the agent picks one of --engine-ports)")
    c.add_argument("--kv-limit", type=size_type, default=None,
                   help="a KV-cache limit to hold from the start, with units (e.g. 4GiB; "
                   "default: none, the engine's own size)")
    c.add_argument("--arg", action="append", default=[], metavar="FLAG[=VALUE]",
                   help="an engine flag, repeatable: --arg --max-model-len=2048, "
                   "--arg --max-model-len 2048, or --arg --enforce-eager (default: none)")
    c = command("deactivate", "stop a model's engine (its whole process tree)")
    c.add_argument("model")
    c = command("sleep", "put a model's engine to sleep")
    c.add_argument("model")
    c.add_argument("--level", type=int, choices=(1, 2), default=1,
                   help="1: weights kept in host memory (fast wake); 2: weights dropped "
                   "(default %(default)s)")
    c.add_argument("--operation-id", help=OPERATION_ID_HELP)
    c = command("wake", "wake a model's engine")
    c.add_argument("model")
    c.add_argument("--operation-id", help=OPERATION_ID_HELP)
    c = command("kv-limit", "set a model's KV-cache limit",
                "Write a KV-cache limit into the engine's kvcached segment and read it back. "
                "The engine's own KV capacity caps it (the answer says so).")
    c.add_argument("model")
    c.add_argument("size", type=size_type, metavar="SIZE",
                   help="with units: 4GiB, 512MiB, 6Gi, or bytes")
    c.add_argument("--operation-id", help=OPERATION_ID_HELP)
    for name in MUTATING:
        sub.choices[name].add_argument(
            "-o", "--output", choices=("text", "json"), default="text",
            help="text (default): one line saying what happened; json: the agent's answer")
    c = command("logs", "the last lines of a model's engine log")
    c.add_argument("model")
    c.add_argument("--tail", type=int, default=100, help="lines (default %(default)s)")
    c = command("events", "engine events, oldest first (-f follows them)",
                "Engine transitions and notable acts. Sequence numbers start again when the "
                "agent restarts; -f says so when it happens and goes on.")
    c.add_argument("-f", "--follow", action="store_true", help="wait for new events")
    c.add_argument("-o", "--output", choices=("text", "json"), default="text",
                   help="text (default) or json: one JSON object per line")
    c = command("wait-drained", "wait until the agent runs no engine (the Pod's preStop)",
                "Wait until the agent runs no engine: while its Pod drains (labelled "
                "claim.model.aibrix.ai/draining, or being deleted), the ModelClaim reconciler "
                "moves its claims to other Pods, make before break, and stops the engines "
                "here. Exits 0 once none runs; 1 at --timeout (the Pod then stops with what "
                "still runs). Says what still runs whenever that changes.")
    c.add_argument("--timeout", type=float, default=DRAIN_WAIT_S,
                   help="seconds (default %(default)g: the pool's grace period, less the "
                   "agent's own stop)")


Body = Callable[[HttpAgentClient], Awaitable[int]]


def guarded(args: argparse.Namespace, body: Body) -> int:
    """Run ``body`` with a client (``agent_client``'s, the reconciler's too: one aiohttp session
    for the command); every failure becomes one line on stderr and an exit code."""
    try:
        source = client_token(args.token_file, os.environ)
    except TokenError as exc:
        print(f"runtime-agent: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    token = source.token() if source is not None else None
    return asyncio.run(_guarded(args.url, token, body))


async def _guarded(url: str, token: str | None, body: Body) -> int:
    async with aiohttp.ClientSession() as session:
        client = HttpAgentClient(url, session, timeout_s=CALL_TIMEOUT_S,
                                 lifecycle_timeout_s=ENGINE_TIMEOUT_S, token=token)
        try:
            return await body(client)
        except Refusal as exc:
            status, message = exc.reply.status, exc.reply.message
            hint = (await pointer(client) if status == 404 and not _unknown_model(message)
                    else "")
            print(f"runtime-agent: the agent answered {status}: {message}{hint}",
                  file=sys.stderr)
            return EXIT_REFUSED
        except NotTheApi as exc:
            print(f"runtime-agent: {url} did not answer as a runtime agent ({exc}); check "
                  "--url (or RUNTIME_AGENT_URL)", file=sys.stderr)
            return EXIT_UNREACHABLE
        except AgentUnreachable as exc:
            print(f"runtime-agent: cannot reach the agent ({exc}); is it running "
                  "(runtime-agent serve)? Set --url or RUNTIME_AGENT_URL", file=sys.stderr)
            return EXIT_UNREACHABLE


async def pointer(client: HttpAgentClient) -> str:
    """When an agent command reached a reconciler or its front door: say where the agent is."""
    for path, key, what in (("/v1/claims", "items", "a ModelClaim reconciler"),
                            ("/v1/models", "data", "the front door (OpenAI-compatible)")):
        try:
            reply = await client.request("GET", path)
        except (AgentUnreachable, NotTheApi):
            continue
        if reply.ok and key in reply.body:
            return (f" — {client.url} is {what}, not a runtime agent; point --url (or "
                    f"RUNTIME_AGENT_URL) at the agent (default {DEFAULT_AGENT_URL})")
    return ""


def run_command(args: argparse.Namespace) -> int:
    async def body(client: HttpAgentClient) -> int:
        try:
            return await _dispatch(client, args)
        except Refusal as exc:
            model = getattr(args, "model", None)
            if exc.reply.status != 404 or model is None or not _unknown_model(exc.reply.message):
                raise
            hint = names_hint(model, await _models(client))
            print(f"runtime-agent: the agent answered 404: {exc.reply.message}{hint}",
                  file=sys.stderr)
            return EXIT_REFUSED

    return guarded(args, body)


def _unknown_model(message: str) -> bool:
    """The agent's 404 for a model it does not run (any other 404: a path of another server)."""
    return "on this agent" in message


def names_hint(model: str, models: list[dict[str, Any]]) -> str:
    """After "not on this agent": the names there are, and the model a claim name stands for."""
    names = sorted(str(m.get("model_name")) for m in models)
    claimed = [str(m.get("model_name")) for m in models
               if (m.get("claim_ref") or {}).get("name") == model]
    if claimed:
        return (f"; {model!r} is the name of the claim of model {claimed[0]!r}: give the "
                "model's name")
    return f"; its models: {', '.join(names)}" if names else "; it runs no model"


async def _dispatch(client: HttpAgentClient, args: argparse.Namespace) -> int:
    if args.command == "snapshot":
        print(render(dict(ok_body(await client.snapshot_reply())),
                     args.output, snapshot_table))
        return 0
    if args.command == "events":
        return await follow(client, args.follow, args.output == "json")
    if args.command == "wait-drained":
        return await wait_drained(client, args.timeout)
    if args.command == "logs":
        for line in ok_body(await client.logs(args.model, args.tail))["lines"]:
            print(line)
        return 0
    started = time.monotonic()
    if args.command == "activate":
        body: dict[str, Any] = {"model_name": args.model, "artifact_url": args.artifact,
                                "engine": args.engine, "port": args.engine_port,
                                "engine_config": {"args": engine_flags(args.arg)}}
        if args.kv_limit is not None:
            body["kv_limit_bytes"] = args.kv_limit
        reply = await client.activate(body, timeout_s=ENGINE_TIMEOUT_S)
    elif args.command == "deactivate":
        reply = await client.deactivate(args.model)
    elif args.command == "kv-limit":
        reply = await client.kv_limit(args.model, args.size, args.operation_id)
    elif args.command == "sleep":
        reply = await client.sleep(args.model, args.level, args.operation_id)
    else:
        reply = await client.wake(args.model, args.operation_id)
    result = ok_body(reply)
    if result.get("note"):  # a deactivated engine a claim owns: it comes back
        print(f"warning: {result['note']}", file=sys.stderr)
    if args.output == "json":
        print(json.dumps(result, indent=2))
    else:
        print(result_line(args.command, args.model, result, time.monotonic() - started,
                          getattr(args, "level", None)))
    return 0 if result.get("status") == "success" else EXIT_REFUSED


async def _models(client: HttpAgentClient) -> list[dict[str, Any]]:
    return list(ok_body(await client.snapshot_reply()).get("models", []))


async def wait_drained(client: HttpAgentClient, timeout_s: float) -> int:
    """``wait-drained``: the agent's engines looked at once a second (a failed or stopped
    engine holds nothing) until none runs or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    said: list[str] | None = None
    while True:
        running = sorted(str(m.get("model_name")) for m in await _models(client)
                         if m.get("phase") not in ("failed", "stopped"))
        if not running:
            print("no engine runs here", flush=True)
            return 0
        if running != said:
            print(f"{len(running)} engine(s) still run here: {', '.join(running)}", flush=True)
            said = running
        if time.monotonic() >= deadline:
            print(f"runtime-agent: {timeout_s:g} s passed and {len(running)} engine(s) still "
                  "run here", file=sys.stderr)
            return EXIT_REFUSED
        await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - time.monotonic())))




def engine_flags(items: Sequence[str]) -> dict[str, str]:
    flags: dict[str, str] = {}
    for item in items:
        flag, _, value = item.partition("=")
        flags[flag] = value
    return flags


def join_arg_values(argv: Sequence[str]) -> list[str]:
    """``activate ... --arg --flag value`` (and ``claims estimate``'s) as ``--arg=--flag=value`` (argparse would read
    ``--flag`` as an option of its own). Whether the next word is the flag's value comes from
    the engine's own flag list (``contract/flags``): a flag that takes no value never takes it;
    one the list does not know takes it unless it starts with ``--``."""
    words = list(argv)
    if "activate" not in words and words[:2] != ["claims", "estimate"]:
        return words
    kind = _engine_in(words)
    arity = known_flags("vllm" if kind == "sim" else kind)
    out: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--arg" and i + 1 < len(words):
            flag = words[i + 1]
            i += 2
            takes = arity.get(flag.replace("_", "-") if flag.startswith("--") else flag)
            if ("=" not in flag and takes != "no-value" and i < len(words)
                    and not words[i].startswith("--")):
                out.append(f"--arg={flag}={words[i]}")
                i += 1
            else:
                out.append(f"--arg={flag}")
            continue
        out.append(word)
        i += 1
    return out


def _engine_in(words: list[str]) -> str:
    for i, word in enumerate(words):
        if word == "--engine" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--engine="):
            return word.split("=", 1)[1]
    return "vllm"


async def follow(client: HttpAgentClient, keep_going: bool, as_json: bool) -> int:
    """Print events from the first; with ``keep_going``, wait for more. A restart of the agent
    (another ``boot_id``) is said in one line, and following goes on from the new boot."""
    cursor, boot = 0, None
    while True:
        page = ok_body(await client.events(cursor, wait=30 if keep_going else 0, boot_id=boot))
        if page.get("reset"):
            print(f"-- the agent restarted (boot {page['boot_id']}): its event numbers start "
                  "again; `runtime-agent snapshot` shows where every engine stands now",
                  flush=True)
            cursor, boot = 0, page["boot_id"]
            continue
        boot = page.get("boot_id", boot)
        for item in page["events"]:
            print(json.dumps(item) if as_json else event_line(item), flush=True)
        cursor = page["cursor"]
        if not keep_going:
            return 0


def event_line(item: dict[str, Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(item["ts"]))
    who = item.get("model") or item.get("artifact_url", "")
    first = item["message"].splitlines()[0] if item.get("message") else ""
    return f"{when} {who}: {item['from']} -> {item['to']} ({item['reason']}) {first}".rstrip()
