"""Where the agent and the reconciler listen, and how an operator may write their address.

Both command lines take ``--url`` as a person types it: ``http://host:port``, ``host:port``,
``:port`` or a bare port. One rule here, so ``runtime-agent snapshot --url node1:8080`` and
``runtime-agent claims get --url node1:8081`` read an address the same way.
"""

from __future__ import annotations

AGENT_PORT = 8080
RECONCILER_PORT = 8081


def base_url(text: str) -> str:
    """``text`` as ``scheme://host[:port]`` without a trailing slash; raises ValueError."""
    url = text.strip().rstrip("/")
    if not url:
        raise ValueError("an empty URL")
    if "://" in url:
        scheme = url.split("://", 1)[0].lower()
        if scheme not in ("http", "https"):
            raise ValueError(f"{text!r}: only http:// and https:// are spoken")
        if not url.split("://", 1)[1]:
            raise ValueError(f"{text!r} names no host")
        return url
    if url.isdigit():  # a bare port: this machine
        return f"http://127.0.0.1:{url}"
    if url.startswith(":") and url[1:].isdigit():
        return f"http://127.0.0.1{url}"
    return f"http://{url}"
