"""The reconciler beside one agent: ``runtime-agent serve --claims DIR``.

The agent's serve starts it once its API listens (so its first look at the agent finds it) and
stops it before it closes its API. Its pool is that one agent (``local_agent``; the claims'
labels select it, ``reconciler.local.desired``), its API asks for the agent's token, and its
front door (``reconciler.door``) is on by default. ``start_embedded`` is the same for tests and
scripts that run an agent of their own.
"""

from __future__ import annotations

import socket
from pathlib import Path

from guard.tokens import TokenSource
from reconciler.door.keys import KeysError
from reconciler.door.settings import DoorSettings
from reconciler.local.app import DEFAULT_PORT, ReconcilerApp, Settings
from reconciler.model.manifests import AgentRef


def local_agent(agent_url: str, name: str | None = None) -> AgentRef:
    return AgentRef(name or socket.gethostname(), agent_url.rstrip("/"))


async def start_embedded(agent_url: str, claims_dir: Path | str, listen_host: str = "127.0.0.1",
                         listen_port: int = DEFAULT_PORT,
                         agent_token: TokenSource | None = None,
                         door: DoorSettings | None = None,
                         status_dir: Path | None = None,
                         auth_reads: bool = False) -> ReconcilerApp:
    """Start a reconciler whose pool is the one agent at ``agent_url`` (and its front door,
    with ``door``); ``await handle.stop()`` stops it. The agent may still be starting: the
    reconciler waits for it. Its API asks for the agent's token (``agent_token``)."""
    app = ReconcilerApp(Settings(Path(claims_dir), host=listen_host, port=listen_port,
                                 local_agent=local_agent(agent_url), agent_token=agent_token,
                                 door=door, status_dir=status_dir, api_token=agent_token,
                                 auth_reads=auth_reads))
    await app.start()
    return app


class EmbeddedReconciler:
    """The reconciler (and its front door) of ``serve --claims``: started once the agent's API
    listens, stopped before it closes its API (its long polls of the agent's event feed are
    gone before the API waits for open connections)."""

    def __init__(self, agent_url: str, claims_dir: str, listen_host: str, listen_port: int,
                 agent_token: TokenSource | None, door: DoorSettings | None,
                 status_dir: Path | None, auth_reads: bool) -> None:
        self._args = (agent_url, claims_dir, listen_host, listen_port, agent_token, door,
                      status_dir, auth_reads)
        self._listen_port = listen_port
        self._door = door
        self._handle: ReconcilerApp | None = None

    async def start(self) -> None:
        try:
            self._handle = await start_embedded(*self._args)
        except KeysError as err:  # broken since the command line read it: one line
            raise SystemExit(f"runtime-agent: the front door cannot start: {err}") from err
        except OSError as err:  # taken since start-up checked it: say which, no stack trace
            door = self._door.port if self._door else "-"
            raise SystemExit(f"runtime-agent: the embedded reconciler (port "
                             f"{self._listen_port}) or its front door (port {door}) cannot "
                             f"listen: {err}; choose other ports with --claims-port / "
                             "--door-port, or --no-door") from err

    async def stop(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            await handle.stop()


def embedded_reconciler(agent_host: str, agent_port: int, claims_dir: str, listen_host: str,
                        listen_port: int, agent_token: TokenSource | None = None,
                        door: DoorSettings | None = None, status_dir: Path | None = None,
                        auth_reads: bool = False) -> EmbeddedReconciler:
    """The embedded reconciler of the agent listening on ``agent_host:agent_port``."""
    host = "127.0.0.1" if agent_host in ("", "0.0.0.0", "::") else agent_host
    host = f"[{host}]" if ":" in host else host
    return EmbeddedReconciler(f"http://{host}:{agent_port}", claims_dir, listen_host,
                              listen_port, agent_token, door, status_dir, auth_reads)
