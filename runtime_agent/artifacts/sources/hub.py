"""The Hugging Face Hub as a source, through ``huggingface_hub`` itself.

The plan pins a branch or tag to the commit it resolves to (the model info API), then asks each
file's resolve URL at that commit for its metadata, as ``hf_hub_download`` does: ``ETag`` or
``X-Linked-Etag`` (an LFS file's sha256, a small file's git blob id), ``X-Linked-Size``,
``X-Repo-Commit``, following the Hub's redirects. Both answers must agree, and the ETag becomes
the file's checksum. The bytes are then streamed from the location the library resolved (the
CDN for an LFS file) with a Range request from the partial file's length, rewinding when a
server ignores the Range; the token goes only to the Hub's own origin. (The library's own
``http_get`` ran at about a third of a plain stream's speed here: its HTTP client, not the
network, was the bottleneck; see bench/RESULTS.md, figure 8.)

The endpoint and token are passed in (``HF_ENDPOINT`` and ``HF_TOKEN`` are read by the CLI
into the settings, a request's credentials may carry its own ``HF_TOKEN``): the library is
never left to find a token on its own.
"""

from __future__ import annotations

import errno
import http.client
import re
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from runtime_agent.artifacts.manifest import Plan, PlannedFile
from runtime_agent.artifacts.sources.base import FetchError, FetchKind
from runtime_agent.artifacts.verify import Cancelled, HashingWriter

_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHA1 = re.compile(r"[0-9a-f]{40}")
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
CHUNK = 1 << 20
TIMEOUT_S = 30.0


class _NoAuthOffOrigin(urllib.request.HTTPRedirectHandler):
    """Follow redirects, but never carry the token to another origin."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> Any:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            new.remove_header("Authorization")
        return new


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc.lower()


def etag_checksum(etag: str | None) -> dict[str, str]:
    """What a Hub ETag says about the bytes: an LFS sha256, a git blob id, or nothing."""
    value = (etag or "").removeprefix("W/").strip('"').lower()
    if _SHA256.fullmatch(value):
        return {"sha256": value}
    if _SHA1.fullmatch(value):
        return {"git-sha1": value}
    return {}


class HubSource:
    def __init__(self, repo_id: str, revision: str, endpoint: str | None,
                 token: str | None) -> None:
        from huggingface_hub.utils import (  # type: ignore[attr-defined,unused-ignore]
            disable_progress_bars,
        )

        disable_progress_bars()  # progress goes to the cache's own counters, not to stderr
        self._repo = repo_id
        self._revision = revision
        self._endpoint = endpoint.rstrip("/") if endpoint else None
        self._token: str | bool = token or False  # False: no token, never one found elsewhere
        self._commit: str | None = None
        self._locations: dict[str, str] = {}  # file -> where its bytes are (from its metadata)
        self._opener = urllib.request.build_opener(_NoAuthOffOrigin())

    def _url(self, filename: str) -> str:
        from huggingface_hub import hf_hub_url

        assert self._commit is not None
        return str(hf_hub_url(self._repo, filename, revision=self._commit,
                              endpoint=self._endpoint))

    def plan(self) -> Plan:
        from huggingface_hub import HfApi, get_hf_file_metadata

        try:
            info = HfApi(endpoint=self._endpoint).model_info(
                self._repo, revision=self._revision, files_metadata=True, token=self._token)
            self._commit = info.sha
            if not self._commit:
                raise FetchError(FetchKind.NETWORK, f"the Hub named no commit for {self._repo}@"
                                 f"{self._revision}")
            files = []
            for sibling in info.siblings or ():
                meta = get_hf_file_metadata(self._url(sibling.rfilename), token=self._token)
                files.append(self._planned(sibling, meta))
        except Exception as exc:  # noqa: BLE001 - the library's errors differ between versions
            raise hub_error(exc, f"{self._repo}@{self._revision}") from None
        if not files:
            raise FetchError(FetchKind.NOT_FOUND, f"{self._repo}@{self._revision} has no files")
        return Plan(tuple(files), resolved_revision=self._commit)

    def _planned(self, sibling: Any, meta: Any) -> PlannedFile:
        name = sibling.rfilename
        if meta.commit_hash and meta.commit_hash != self._commit:
            raise FetchError(FetchKind.CHANGED, f"{name} resolved to commit {meta.commit_hash}, "
                             f"not {self._commit}")
        listed = sibling.lfs.size if sibling.lfs else sibling.size
        size = meta.size if meta.size is not None else listed
        if size is None or (listed is not None and listed != size):
            raise FetchError(FetchKind.CHANGED, f"{name}: the Hub gives sizes {listed} and "
                             f"{meta.size}")
        checksums = etag_checksum(meta.etag)
        announced = ({"sha256": sibling.lfs.sha256} if sibling.lfs else
                     {"git-sha1": sibling.blob_id} if sibling.blob_id else {})
        for algorithm, value in announced.items():
            if checksums.setdefault(algorithm, value) != value:
                raise FetchError(FetchKind.CHANGED, f"{name}: the file's ETag ({meta.etag}) is "
                                 f"not the {algorithm} the repository lists ({value})")
        self._locations[name] = meta.location or self._url(name)
        return PlannedFile(name, int(size), checksums, locator=name, etag=meta.etag)

    def fetch(self, file: PlannedFile, writer: HashingWriter, offset: int) -> None:
        if self._commit is None:
            raise FetchError(FetchKind.NETWORK, "fetch before plan")
        url = self._locations.get(file.locator) or self._url(file.locator)
        headers = {"Accept-Encoding": "identity", "User-Agent": "warm-pool-runtime-agent"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        hub = self._endpoint or "https://huggingface.co"
        if self._token and _origin(url) == _origin(hub):
            headers["Authorization"] = f"Bearer {self._token}"
        try:
            with self._opener.open(urllib.request.Request(url, headers=headers),
                                   timeout=TIMEOUT_S) as resp:
                if offset and resp.status != 206:  # the server ignored the Range: start over
                    writer.seek(0)
                    writer.truncate()
                while chunk := resp.read(CHUNK):
                    writer.write(chunk)
        except (Cancelled, FetchError):
            raise
        except urllib.error.HTTPError as exc:
            kind = FetchKind.AUTH if exc.code in (401, 403) else (
                FetchKind.NOT_FOUND if exc.code == 404 else FetchKind.NETWORK)
            raise FetchError(kind, f"{file.path}: the Hub answered {exc.code} {exc.reason}") \
                from None
        except OSError as exc:
            if exc.errno in DISK_ERRNOS:
                raise
            raise FetchError(FetchKind.NETWORK, f"{file.path}: {exc}") from None
        except http.client.HTTPException as exc:  # IncompleteRead: the connection broke
            raise FetchError(FetchKind.NETWORK, f"{file.path}: {exc!r}") from None

    def set_commit(self, commit: str) -> None:
        """Resume at the commit an earlier plan resolved to (so no second plan is needed)."""
        self._commit = commit


def hub_error(exc: BaseException, what: str) -> FetchError:
    """The library's error as a FetchError that says what to do about it."""
    if isinstance(exc, FetchError):
        return exc
    from huggingface_hub import errors

    status = getattr(getattr(exc, "response", None), "status_code", None)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, errors.GatedRepoError):
        return FetchError(FetchKind.AUTH, f"{what} is gated: pass a token with access "
                          "(HF_TOKEN in credentials or the agent's environment)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return FetchError(FetchKind.NOT_FOUND, f"repository of {what} not found, or private "
                          "without a valid token (HF_TOKEN)")
    if isinstance(exc, errors.RevisionNotFoundError):
        return FetchError(FetchKind.NOT_FOUND, f"revision of {what} not found")
    if isinstance(exc, errors.EntryNotFoundError):
        return FetchError(FetchKind.NOT_FOUND, f"{what}: file not found on the Hub")
    if status in (401, 403):
        return FetchError(FetchKind.AUTH, f"{what}: the Hub refused the token ({status})")
    return FetchError(FetchKind.NETWORK, f"{what}: {first}")
