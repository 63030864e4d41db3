"""S3 and S3-compatible stores as a source, through boto3.

``s3://bucket/key`` is one object; ``s3://bucket/prefix`` (no object of that name) is every
object under ``prefix/``, kept at its path below the prefix. The plan asks each object's HEAD
with ``ChecksumMode=ENABLED``: a full-object SHA-256, SHA-1 or CRC-32 is checked on arrival, and
a plain ETag (one-part upload, no KMS) is its MD5. Composite checksums of multipart uploads
cover parts, not the object, so those files are checked by size only. Bytes come from
``GetObject`` with ``Range`` from the partial file's length and ``IfMatch`` on the planned ETag,
so a resumed file never mixes two versions of an object.

Credentials: a request's ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``
(and ``AWS_REGION``, ``AWS_ENDPOINT_URL``) when given, else boto3's own chain (environment,
profile, instance role). The endpoint override comes from the settings or the request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from runtime_agent.artifacts.manifest import Plan, PlannedFile
from runtime_agent.artifacts.sources.base import FetchError, FetchKind
from runtime_agent.artifacts.sources.hub import DISK_ERRNOS
from runtime_agent.artifacts.verify import Cancelled, HashingWriter, b64_to_hex

CHUNK = 1 << 20
_PLAIN_ETAG = re.compile(r'"?([0-9a-f]{32})"?')
_CHECKSUMS = (("ChecksumSHA256", "sha256"), ("ChecksumSHA1", "sha1"), ("ChecksumCRC32", "crc32"))
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
               "InvalidToken", "AllAccessDisabled", "403", "401"}
_MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}


def object_checksums(head: Mapping[str, Any]) -> dict[str, str]:
    """The checksums a HEAD answer vouches for, as hex."""
    out: dict[str, str] = {}
    for field, algorithm in _CHECKSUMS:
        value = head.get(field)
        if isinstance(value, str) and "-" not in value and head.get("ChecksumType") != "COMPOSITE":
            out[algorithm] = b64_to_hex(value)
    etag = head.get("ETag")
    plain = _PLAIN_ETAG.fullmatch(etag) if isinstance(etag, str) else None
    if plain and head.get("ServerSideEncryption") != "aws:kms":
        out["md5"] = plain.group(1)
    return out


class S3Source:
    def __init__(self, bucket: str, key: str, endpoint_url: str | None,
                 credentials: Mapping[str, str]) -> None:
        self._bucket = bucket
        self._key = key
        self._endpoint = credentials.get("AWS_ENDPOINT_URL") or endpoint_url
        self._credentials = credentials
        self._client: Any = None

    def _s3(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            c = self._credentials
            session = boto3.session.Session(
                aws_access_key_id=c.get("AWS_ACCESS_KEY_ID"),
                aws_secret_access_key=c.get("AWS_SECRET_ACCESS_KEY"),
                aws_session_token=c.get("AWS_SESSION_TOKEN"),
                region_name=c.get("AWS_REGION") or c.get("AWS_DEFAULT_REGION"))
            # The cache checks each file itself; botocore need not hash a whole GET a second time.
            config = Config(retries={"max_attempts": 3, "mode": "standard"},
                            response_checksum_validation="when_required",
                            connect_timeout=10, read_timeout=60)
            self._client = session.client("s3", endpoint_url=self._endpoint, config=config)
        return self._client

    def plan(self) -> Plan:
        try:
            return self._plan()
        except FetchError:
            raise
        except Exception as exc:  # noqa: BLE001 - botocore's errors are many
            raise s3_error(exc, f"s3://{self._bucket}/{self._key}") from None

    def _plan(self) -> Plan:
        s3 = self._s3()
        head = self._head(self._key)
        if head is not None:
            name = self._key.rsplit("/", 1)[-1]
            return Plan((self._planned(name, self._key, head),))
        prefix = self._key.rstrip("/") + "/"
        files = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self._bucket,
                                                                 Prefix=prefix):
            for obj in page.get("Contents", ()):
                key = obj["Key"]
                if key.endswith("/"):
                    continue  # a folder marker
                head = self._head(key)
                if head is not None:
                    files.append(self._planned(key[len(prefix):], key, head))
        if not files:
            raise FetchError(FetchKind.NOT_FOUND, f"no object s3://{self._bucket}/{self._key} "
                             f"and none under s3://{self._bucket}/{prefix}")
        return Plan(tuple(sorted(files, key=lambda f: f.path)))

    def _head(self, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            return dict(self._s3().head_object(Bucket=self._bucket, Key=key,
                                               ChecksumMode="ENABLED"))
        except ClientError as exc:
            if _code(exc) in _MISSING_CODES:
                return None
            raise

    @staticmethod
    def _planned(path: str, key: str, head: Mapping[str, Any]) -> PlannedFile:
        return PlannedFile(path, int(head["ContentLength"]), object_checksums(head), locator=key,
                           etag=head.get("ETag"))

    def fetch(self, file: PlannedFile, writer: HashingWriter, offset: int) -> None:
        if offset >= file.size:
            return
        args: dict[str, Any] = {"Bucket": self._bucket, "Key": file.locator}
        if offset:
            args["Range"] = f"bytes={offset}-"
        if file.etag:
            args["IfMatch"] = file.etag
        try:
            body = self._s3().get_object(**args)["Body"]
            try:
                for chunk in body.iter_chunks(CHUNK):
                    writer.write(chunk)
            finally:
                body.close()
        except (Cancelled, FetchError):
            raise
        except OSError as exc:
            if exc.errno in DISK_ERRNOS:
                raise
            raise s3_error(exc, file.path) from None
        except Exception as exc:  # noqa: BLE001
            raise s3_error(exc, file.path) from None


def _code(exc: Any) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def s3_error(exc: BaseException, what: str) -> FetchError:
    code = _code(exc)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if code in _AUTH_CODES or type(exc).__name__ in ("NoCredentialsError",
                                                      "PartialCredentialsError"):
        return FetchError(FetchKind.AUTH, f"{what}: {first} (pass AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY in credentials, or give the agent credentials)")
    if code in _MISSING_CODES:
        return FetchError(FetchKind.NOT_FOUND, f"{what}: {first}")
    if code in ("PreconditionFailed", "412"):
        return FetchError(FetchKind.CHANGED, f"{what} changed during the download; its partial "
                          "copy was dropped: download it again")
    return FetchError(FetchKind.NETWORK, f"{what}: {first}")
