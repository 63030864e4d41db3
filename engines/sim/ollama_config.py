"""The environment of one simulated ``ollama serve``, read the way Ollama's ``envconfig`` reads it.

A supervisor configures each Ollama server only through its environment: ``OLLAMA_HOST`` (where it
listens), ``OLLAMA_CONTEXT_LENGTH`` (per-request context), ``OLLAMA_NUM_PARALLEL`` (slots per loaded
model), ``OLLAMA_KEEP_ALIVE`` (how long an idle model stays loaded) and ``OLLAMA_MODELS`` (the models
directory). The parsers below follow Ollama's own rules (checked against ``envconfig/config.go`` and
``api/types.go``), so a value the agent gets wrong fails here the way it would with the real server.
Model names are normalised as Ollama displays them (``llama3.2`` -> ``llama3.2:latest``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from contract.numbers import whole_number

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11434
DEFAULT_CONTEXT_LENGTH = 4096
DEFAULT_NUM_PARALLEL = 1
DEFAULT_KEEP_ALIVE_S = 300.0
FOREVER = math.inf  # Ollama's "negative keep_alive": time.Duration(math.MaxInt64)
_DEFAULT_REGISTRY = "registry.ollama.ai/"
_DEFAULT_NAMESPACE = "library/"
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


@dataclass(frozen=True)
class OllamaSettings:
    """The server-wide settings; ``keep_alive_s`` is seconds, ``FOREVER`` for a negative keep-alive."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    context_length: int = DEFAULT_CONTEXT_LENGTH
    num_parallel: int = DEFAULT_NUM_PARALLEL
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    models_dir: str = ""
    warnings: tuple[str, ...] = ()  # unusable values replaced by defaults, as Ollama logs them


def parse_go_duration(text: str) -> float:
    """Go's ``time.ParseDuration`` in seconds ("5m", "1h30m", "-1s", "0"); ValueError like Go's."""
    raw = text.strip()
    body = raw.lstrip("+-")
    sign = -1.0 if raw.startswith("-") else 1.0
    if body == "0":
        return 0.0
    if not body:
        raise ValueError(f'time: invalid duration "{text}"')
    total, position = 0.0, 0
    while position < len(body):
        match = _GO_PART.match(body, position)
        if match is None:
            if re.match(r"(\d+(?:\.\d*)?|\.\d+)$", body[position:]):
                raise ValueError(f'time: missing unit in duration "{text}"')
            raise ValueError(f'time: invalid duration "{text}"')
        total += float(match[1]) * _GO_UNITS[match[2]]
        position = match.end()
    return sign * total


def keep_alive_from_env(value: str | None) -> float:
    """``OLLAMA_KEEP_ALIVE``: a Go duration or whole seconds; negative = forever; junk = the default."""
    seconds = DEFAULT_KEEP_ALIVE_S
    text = (value or "").strip()
    if text:
        try:
            seconds = parse_go_duration(text)
        except ValueError:
            try:
                seconds = float(int(text))
            except ValueError:
                pass  # Ollama silently keeps the default
    return FOREVER if seconds < 0 else seconds


def keep_alive_from_json(value: object) -> float:
    """A request's ``keep_alive``: seconds as a number or a Go duration string; negative = forever."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"Unsupported type: '{type(value).__name__}'")
    seconds = float(value) if not isinstance(value, str) else parse_go_duration(value)
    return FOREVER if seconds < 0 else seconds


def parse_host(value: str | None) -> tuple[str, int]:
    """``OLLAMA_HOST`` (``host:port``, ``http://host:port``, ``:port``, ``host``) -> (host, port)."""
    text = (value or "").strip()
    default_port = DEFAULT_PORT
    scheme, sep, hostport = text.partition("://")
    if not sep:
        hostport = text
    elif scheme == "http":
        default_port = 80
    elif scheme == "https":
        default_port = 443
    hostport = hostport.split("/", 1)[0]
    host, port_text = DEFAULT_HOST, str(default_port)
    split = _split_host_port(hostport)
    if split is None:
        bare = hostport.strip("[]")
        if bare:
            host = bare
    else:
        host, port_text = split
        host = host or ""  # ":11434" listens on every interface, as Go's net.Listen does
    try:
        port = int(port_text)
    except ValueError:
        port = default_port
    if not 0 <= port <= 65535:
        port = default_port
    return (host or "0.0.0.0"), port


def _split_host_port(hostport: str) -> tuple[str, str] | None:
    """Go's ``net.SplitHostPort``, or None when there is no port."""
    if hostport.startswith("["):
        end = hostport.find("]")
        if end < 0 or not hostport[end + 1:].startswith(":"):
            return None
        return hostport[1:end], hostport[end + 2:]
    if hostport.count(":") != 1:
        return None  # no port, or a bare IPv6 address
    host, port = hostport.split(":")
    return host, port


def _unsigned(env: Mapping[str, str], name: str, default: int, warnings: list[str]) -> int:
    """Ollama's ``envconfig.Uint``: an unparsable value is logged and replaced by the default; 0 = default."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    value = whole_number(raw)
    if value is None:
        warnings.append(f"invalid environment variable, using default key={name} value={raw} default={default}")
        return default
    return value or default


def settings_from_env(env: Mapping[str, str]) -> OllamaSettings:
    """Read the ``OLLAMA_*`` variables the way Ollama does (never refusing to start over one)."""
    host, port = parse_host(env.get("OLLAMA_HOST"))
    models_dir = env.get("OLLAMA_MODELS", "").strip() or os.path.join(os.path.expanduser("~"), ".ollama", "models")
    warnings: list[str] = []
    return OllamaSettings(
        host=host,
        port=port,
        context_length=_unsigned(env, "OLLAMA_CONTEXT_LENGTH", DEFAULT_CONTEXT_LENGTH, warnings),
        num_parallel=_unsigned(env, "OLLAMA_NUM_PARALLEL", DEFAULT_NUM_PARALLEL, warnings),
        keep_alive_s=keep_alive_from_env(env.get("OLLAMA_KEEP_ALIVE")),
        models_dir=models_dir,
        warnings=tuple(warnings),
    )


def normalize_model_name(name: str) -> str:
    """The name as Ollama displays it: default registry and namespace dropped, ``:latest`` added."""
    text = name.strip()
    if text.startswith(_DEFAULT_REGISTRY):
        text = text[len(_DEFAULT_REGISTRY):]
    if text.startswith(_DEFAULT_NAMESPACE):
        text = text[len(_DEFAULT_NAMESPACE):]
    last = text.rsplit("/", 1)[-1]
    if text and ":" not in last:
        text += ":latest"
    return text


def valid_model_name(name: str) -> bool:
    """A loose version of Ollama's ``ParseName(...).IsValid()``: a non-empty model part."""
    text = normalize_model_name(name)
    model = text.rsplit("/", 1)[-1].split(":", 1)[0]
    return bool(model) and not any(ch.isspace() for ch in text)
