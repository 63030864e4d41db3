"""A local Hugging Face Hub for tests and benchmarks: it answers ``huggingface_hub``'s requests as
the Hub does, so the library itself runs against it.

* ``GET /api/models/{repo}[/revision/{rev}]`` (``?blobs=true``): the model info with ``sha`` and
  ``siblings`` (``rfilename``, ``size``, ``blobId``, ``lfs`` {sha256, size, pointerSize}).
* ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: a small file answers 200 with its git blob id
  as ``ETag``; an LFS file answers 302 to the CDN (another origin) with ``X-Linked-Etag`` (its
  sha256), ``X-Linked-Size`` and the pointer's own ``ETag``; both carry ``X-Repo-Commit``.
  Errors carry ``X-Error-Code`` (``RepoNotFound`` as 401 without a valid token for a private
  repository, ``RevisionNotFound``, ``EntryNotFound``), as the library reads them.
* The CDN serves blobs with ``Range`` (206, ``Content-Range``).

Faults for tests: ``cut_after`` (close the connection after N bytes of a file's next GET),
``outage`` (the CDN answers 503), ``corrupt`` (a flipped byte, same length), ``rate``
(bytes per second). Every request is logged with its Range header.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_MIN = 1024  # files at least this big (or *.safetensors) are LFS files, as git-lfs would have them
CHUNK = 1 << 20


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class Blob:
    """A file's content, in memory or on disk."""

    data: bytes | None = None
    path: Path | None = None
    _sha256: str | None = None  # computed once: the server must not be the bottleneck

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else self.path.stat().st_size  # type: ignore

    def read(self, start: int, end: int) -> bytes:
        if self.data is not None:
            return self.data[start:end]
        assert self.path is not None
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def sha256(self) -> str:
        if self._sha256 is None:
            self._sha256 = self._digest()
        return self._sha256

    def _digest(self) -> str:
        if self.data is not None:
            return hashlib.sha256(self.data).hexdigest()
        h = hashlib.sha256()
        with open(self.path, "rb") as f:  # type: ignore[arg-type]
            while chunk := f.read(CHUNK):
                h.update(chunk)
        return h.hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    token: str | None = None  # private: this bearer token is needed

    def resolve(self, revision: str) -> str | None:
        return self.refs.get(revision) or (revision if revision in self.commits else None)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.cut_after: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.outage = False
        self.rate: float | None = None
        self._sha_index: dict[str, Blob] = {}
        self._lock = threading.Lock()
        self._servers: list[ThreadingHTTPServer] = []
        self.url = self.cdn_url = ""

    # ---- content ----------------------------------------------------------------------------

    def add_repo(self, repo_id: str, files: dict[str, bytes | Path], revision: str = "main",
                 token: str | None = None) -> str:
        """A new commit on ``revision`` with these files; its sha."""
        repo = self.repos.setdefault(repo_id, Repo(token=token))
        blobs = {name: Blob(data=v) if isinstance(v, bytes) else Blob(path=v)
                 for name, v in files.items()}
        sha = hashlib.sha1(f"{repo_id}:{len(repo.commits)}:{sorted(files)}".encode()).hexdigest()
        repo.commits[sha] = blobs
        repo.refs[revision] = sha
        for name, blob in blobs.items():
            if self._is_lfs(name, blob):
                self._sha_index[blob.sha256()] = blob
        return sha

    @staticmethod
    def _is_lfs(name: str, blob: Blob) -> bool:
        return blob.size >= LFS_MIN or name.endswith(".safetensors")

    def gets(self, suffix: str) -> list[str | None]:
        """The Range headers of the GETs whose path ends with ``suffix``."""
        with self._lock:
            return [r for m, p, r in self.requests
                    if m == "GET" and urlsplit(p).path.endswith(suffix)]

    # ---- serving ----------------------------------------------------------------------------

    def start(self) -> FakeHub:
        hub = self

        class Api(_Handler):
            def route(self, head: bool) -> None:
                hub._api(self, head)

        class Cdn(_Handler):
            def route(self, head: bool) -> None:
                hub._cdn(self, head)

        for handler in (Api, Cdn):
            server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self._servers.append(server)
        self.url = f"http://127.0.0.1:{self._servers[0].server_address[1]}"
        # Another origin (localhost, not 127.0.0.1): the library treats it as a CDN.
        self.cdn_url = f"http://localhost:{self._servers[1].server_address[1]}"
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def _log(self, req: BaseHTTPRequestHandler, method: str) -> None:
        with self._lock:
            self.requests.append((method, req.path, req.headers.get("Range")))

    def _authorised(self, req: BaseHTTPRequestHandler, repo: Repo) -> bool:
        return repo.token is None or req.headers.get("Authorization") == f"Bearer {repo.token}"

    def _api(self, req: _Handler, head: bool) -> None:
        self._log(req, "HEAD" if head else "GET")
        path = unquote(urlsplit(req.path).path)
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):]
            repo_id, _, revision = rest.partition("/revision/")
            self._model_info(req, repo_id, revision or "main",
                             parse_qs(urlsplit(req.path).query))
            return
        parts = path.lstrip("/").split("/resolve/", 1)
        if len(parts) != 2:
            req.error(404, "RepoNotFound", "no such route")
            return
        repo_id, rest = parts
        revision, _, filename = rest.partition("/")
        found = self._commit(req, repo_id, revision)
        if found is None:
            return
        repo, sha = found
        blob = repo.commits[sha].get(filename)
        if blob is None:
            req.error(404, "EntryNotFound", f"{filename} does not exist", {"X-Repo-Commit": sha})
            return
        if self._is_lfs(filename, blob):
            digest = blob.sha256()
            pointer = lfs_pointer(digest, blob.size)
            req.send_response(302)
            for k, v in {"Location": f"{self.cdn_url}/blobs/{digest}?name={quote(filename)}",
                         "ETag": f'"{git_blob_id(pointer)}"',
                         "X-Linked-Etag": f'"{digest}"', "X-Linked-Size": str(blob.size),
                         "X-Repo-Commit": sha, "Content-Length": "0"}.items():
                req.send_header(k, v)
            req.end_headers()
            return
        etag = git_blob_id(blob.read(0, blob.size))
        self._serve(req, head, blob, filename, {"ETag": f'"{etag}"', "X-Repo-Commit": sha})

    def _commit(self, req: _Handler, repo_id: str, revision: str) -> tuple[Repo, str] | None:
        """The repository and the commit ``revision`` names, or None once the error is sent
        (401 RepoNotFound for a missing or private one without its token, as the Hub does)."""
        repo = self.repos.get(repo_id)
        if repo is None or not self._authorised(req, repo):
            req.error(401, "RepoNotFound", "Repository not found")
            return None
        sha = repo.resolve(revision)
        if sha is None:
            req.error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo, sha

    def _model_info(self, req: _Handler, repo_id: str, revision: str,
                    query: dict[str, list[str]]) -> None:
        found = self._commit(req, repo_id, revision)
        if found is None:
            return
        repo, sha = found
        blobs = query.get("blobs") == ["True"] or query.get("blobs") == ["true"]
        siblings: list[dict[str, Any]] = []
        for name, blob in sorted(repo.commits[sha].items()):
            item: dict[str, Any] = {"rfilename": name}
            if blobs:
                item["size"] = blob.size
                if self._is_lfs(name, blob):
                    item["blobId"] = git_blob_id(lfs_pointer(blob.sha256(), blob.size))
                    item["lfs"] = {"sha256": blob.sha256(), "size": blob.size,
                                   "pointerSize": len(lfs_pointer(blob.sha256(), blob.size))}
                else:
                    item["blobId"] = git_blob_id(blob.read(0, blob.size))
            siblings.append(item)
        body = json.dumps({"_id": sha[:24], "id": repo_id, "modelId": repo_id, "sha": sha,
                           "private": repo.token is not None, "siblings": siblings}).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)

    def _cdn(self, req: _Handler, head: bool) -> None:
        self._log(req, "HEAD" if head else "GET")
        path = urlsplit(req.path)
        digest = path.path.rsplit("/", 1)[-1]
        blob = self._sha_index.get(digest)
        if blob is None:
            req.error(404, "EntryNotFound", "no such blob")
            return
        name = parse_qs(path.query).get("name", [""])[0]
        if self.outage and name not in self.cut_after:  # a pending cut is served first
            req.error(503, "ServiceUnavailable", "the CDN is down")
            return
        self._serve(req, head, blob, name, {"ETag": f'"{digest}"'})

    def _serve(self, req: _Handler, head: bool, blob: Blob, name: str,
               headers: dict[str, str]) -> None:
        size = blob.size
        start, end = 0, size
        rng = req.headers.get("Range")
        if rng and rng.startswith("bytes="):
            first, _, last = rng[len("bytes="):].partition("-")
            start = int(first or 0)
            end = int(last) + 1 if last else size
        if start >= size and size:
            req.error(416, "RangeNotSatisfiable", f"bytes */{size}")
            return
        req.send_response(206 if rng else 200)
        for k, v in {**headers, "Accept-Ranges": "bytes", "Content-Length": str(end - start),
                     **({"Content-Range": f"bytes {start}-{end - 1}/{size}"} if rng else {})
                     }.items():
            req.send_header(k, v)
        req.end_headers()
        if head:
            return
        cut = self.cut_after.pop(name, None)
        pos = start
        t0 = time.monotonic()
        while pos < end:
            n = min(CHUNK if self.rate is None else 64 << 10, end - pos)
            if cut is not None and pos + n > cut:
                n = max(0, cut - pos)
            chunk = bytearray(blob.read(pos, pos + n))
            if name in self.corrupt and pos <= size // 2 < pos + n:
                chunk[size // 2 - pos] ^= 0xFF
            try:
                req.wfile.write(chunk)
            except OSError:
                return
            pos += n
            if cut is not None and pos >= cut:
                req.close_connection = True
                req.wfile.flush()
                req.connection.shutdown(2)
                return
            if self.rate:
                ahead = (pos - start) / self.rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def route(self, head: bool) -> None:
        raise NotImplementedError

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.route(False)

    def do_HEAD(self) -> None:  # noqa: N802
        self.route(True)

    def error(self, status: int, code: str, message: str,
              extra: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        for k, v in {"X-Error-Code": code, "X-Error-Message": message,
                     "Content-Type": "application/json", "Content-Length": str(len(body)),
                     **(extra or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        return
