"""The weight cache's pure parts and its disk rules, without an agent: URLs, room and eviction,
rates, the hashing writer, one transfer against an in-memory source, and the start-up scan."""

from __future__ import annotations

import hashlib
import io
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime_agent.artifacts.manifest import JobFile, Manifest, Plan, PlannedFile
from runtime_agent.artifacts.planning import Evictable, Rate, eta_s, make_room
from runtime_agent.artifacts.sources.base import FetchError, FetchKind
from runtime_agent.artifacts.sources.hub import etag_checksum
from runtime_agent.artifacts.sources.s3 import object_checksums
from runtime_agent.artifacts.store import CacheDisk
from runtime_agent.artifacts.transfer import PART, safe_path, transfer
from runtime_agent.artifacts.urls import (
    ArtifactRequestError,
    SourceKind,
    local_path_problem,
    parse_artifact,
)
from runtime_agent.artifacts.verify import HashingWriter, Progress

NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True).filter(
    lambda s: ".." not in s)


@given(org=NAME, name=NAME, slash=st.booleans())
def test_hf_and_huggingface_urls_name_one_entry(org: str, name: str, slash: bool) -> None:
    a = parse_artifact(f"hf://{org}/{name}" + ("/" if slash else ""))
    b = parse_artifact(f"huggingface://{org}/{name}")
    assert a == b and a.kind is SourceKind.HUB and a.revision == "main"
    assert a.entry_id != parse_artifact(a.url, "v1").entry_id  # a revision is its own entry


def test_urls_the_cache_cannot_fetch_say_what_it_can() -> None:
    for url, status in (("gcs://b/m", 422), ("not-a-url", 422), ("hf://a/../b", 400),
                        ("s3://Bad_Bucket/x", 400), ("s3://bucket", 400), ("file://rel", 400)):
        with pytest.raises(ArtifactRequestError) as err:
            parse_artifact(url)
        assert err.value.status == status, url
    with pytest.raises(ArtifactRequestError):
        parse_artifact("s3://bucket/key", revision="main")
    assert parse_artifact("file:///a/b/../c").location == "/a/c"


def test_a_local_refusal_is_the_same_whether_the_path_exists(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "there").mkdir()
    (root / "link").symlink_to(tmp_path / "there")
    answers = {local_path_problem(str(p), (root,)) for p in
               (tmp_path / "there", tmp_path / "absent", root / "link", root / "link" / "x")}
    assert len(answers) == 1 and next(iter(answers))[0] == 403  # type: ignore[index]
    assert local_path_problem(str(root / "absent"), (root,))[0] == 404  # type: ignore[index]
    assert local_path_problem(str(tmp_path / "there"), ())[0] == 403  # type: ignore[index]


ENTRIES = st.lists(st.tuples(st.integers(1, 100), st.floats(0, 1000)), max_size=8)


@given(need=st.integers(0, 500), free=st.integers(0, 500), reserve=st.integers(0, 100),
       committed=st.integers(0, 100), entries=ENTRIES)
def test_room_is_made_from_the_least_recently_used_and_only_when_needed(
        need: int, free: int, reserve: int, committed: int,
        entries: list[tuple[int, float]]) -> None:
    cands = [Evictable(f"e{i}", size, used) for i, (size, used) in enumerate(entries)]
    room = make_room(need, free, reserve, committed, cands)
    short = need + committed + reserve - free
    freed = sum(c.size for c in cands if c.entry_id in room.evict)
    if short <= 0:
        assert room.ok and room.evict == ()
    elif room.ok:
        assert freed >= short
        lru = sorted(cands, key=lambda c: (c.last_used_at, c.entry_id))
        assert list(room.evict) == [c.entry_id for c in lru[:len(room.evict)]]
        assert freed - cands[int(room.evict[-1][1:])].size < short  # no extra victim
    else:
        assert sum(c.size for c in cands) < short and "not enough disk space" in room.message


def test_the_rate_follows_the_bytes_and_gives_an_eta() -> None:
    rate = Rate(0.0, 0).next(1.0, 100).next(2.0, 200)
    assert rate.per_s == pytest.approx(100.0)
    assert eta_s(rate.per_s, 200, 1200) == pytest.approx(10.0)
    assert eta_s(None, 0, 10) is None and eta_s(5.0, 10, 10) == 0.0


def test_checksums_come_from_hub_etags_and_s3_heads() -> None:
    assert etag_checksum('"' + "a" * 64 + '"') == {"sha256": "a" * 64}
    assert etag_checksum('W/"' + "b" * 40 + '"') == {"git-sha1": "b" * 40}
    assert etag_checksum("xyz") == {}
    head = {"ChecksumSHA256": "IyKysjazkhEglGcnleUOssMmsSIQf+cqB1OiPB/ryzk=",
            "ETag": '"4dac9b8061f8155bc524f0f66318ffb8"'}
    assert set(object_checksums(head)) == {"sha256", "md5"}
    assert object_checksums({"ETag": '"abc-3"', "ChecksumCRC32": "AAAA-2"}) == {}


def test_the_writer_hashes_a_resumed_prefix_and_a_rewind() -> None:
    data = b"0123456789" * 1000
    fh = io.BytesIO(data[:4000])
    fh.seek(4000)
    progress = Progress(len(data))
    writer = HashingWriter(fh, "sha256", len(data), 4000, progress, threading.Event())
    writer.write(data[4000:6000])
    writer.seek(0)  # what huggingface_hub does when a server ignores the Range
    writer.truncate()
    writer.write(data)
    assert writer.hexdigest() == hashlib.sha256(data).hexdigest() and progress.done == len(data)


class MemorySource:
    def __init__(self, files: dict[str, bytes], announced: dict[str, bytes] | None = None) -> None:
        self.files = files
        self.announced = announced or files
        self.offsets: list[int] = []

    def plan(self) -> Plan:
        return Plan(tuple(PlannedFile(n, len(d), {"sha256": hashlib.sha256(d).hexdigest()},
                                      locator=n) for n, d in sorted(self.announced.items())))

    def fetch(self, file: PlannedFile, writer: HashingWriter, offset: int) -> None:
        self.offsets.append(offset)
        writer.write(self.files[file.path][offset:])


def test_a_transfer_resumes_a_part_and_removes_a_file_that_fails_its_checksum(
        tmp_path: Path) -> None:
    good = b"x" * 5000
    (tmp_path / "a.bin.part").write_bytes(good[:1200])
    source = MemorySource({"a.bin": good})
    assert transfer(source, source.plan(), tmp_path, Progress(), threading.Event()) == ("sha256",)
    assert source.offsets == [1200] and (tmp_path / "a.bin").read_bytes() == good
    bad = MemorySource({"b.bin": b"y" * 10}, announced={"b.bin": b"z" * 10})
    with pytest.raises(FetchError) as err:
        transfer(bad, bad.plan(), tmp_path, Progress(), threading.Event())
    assert err.value.kind is FetchKind.CHECKSUM
    assert not (tmp_path / "b.bin").exists() and not (tmp_path / f"b.bin{PART}").exists()
    for hostile in ("../escape", "a/../../escape", "/etc/passwd", "a\x00b", "a\nb"):
        with pytest.raises(FetchError) as refused:
            safe_path(tmp_path, hostile)
        assert refused.value.kind is FetchKind.REFUSED, hostile


def test_the_scan_keeps_whole_entries_and_drops_broken_ones(tmp_path: Path) -> None:
    disk = CacheDisk(tmp_path)
    disk.prepare()
    files = (PlannedFile("w", 3),)
    for entry_id, content in (("good", b"abc"), ("short", b"ab")):
        (disk.ready_files(entry_id)).mkdir(parents=True)
        (disk.ready_files(entry_id) / "w").write_bytes(content)
        disk.save_manifest(Manifest(entry_id, "s3://b/k", "s3", None, None, files, 3, 1.0, 1.0))
    (disk.ready / "nomanifest").mkdir()
    disk.write_job(JobFile("dl", "s3://b/k2", "s3", None, True, 1.0, Plan(files)))
    (disk.staging_dir("dl") / "files" / f"w{PART}").write_bytes(b"a")
    scan = disk.scan()
    assert [m.entry_id for m in scan.ready] == ["good"]
    assert [(j.entry_id, n) for j, n in scan.staged] == [("dl", 1)]
    assert len(scan.dropped) == 2 and sorted(p.name for p in disk.ready.iterdir()) == ["good"]
