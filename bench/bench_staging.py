"""Figure 8: weight-cache staging throughput next to a plain copy of the same bytes.

The same artifact is fetched from the same local server two ways: staged by the real agent
(``POST /v1/model/download`` until the entry is ready: plan, transfer, checksum on arrival,
fsync, manifest, rename into ``ready/``), and copied plainly (one streaming GET into a file,
then fsync: what ``curl -o`` plus a sync would cost). The ratio of the two times is the cache's
overhead. Sources: the local Hub of ``tests.hubserver`` (``huggingface_hub`` downloads) and
moto's S3 server (boto3). Medians of ``--runs`` runs each, interleaved.

    python -m bench.bench_staging [--size-mib 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Result
from tests.harness import AgentProcess
from tests.hubserver import FakeHub

GOAL = 1.10  # staging takes at most 10% longer than a plain copy
MIB = 1 << 20


def plain_http(url: str, dest: Path) -> None:
    with urllib.request.urlopen(url, timeout=60) as resp, open(dest, "wb") as f:
        while chunk := resp.read(MIB):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def plain_s3(client: Any, bucket: str, key: str, dest: Path) -> None:
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    with open(dest, "wb") as f:
        for chunk in body.iter_chunks(MIB):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def staged(agent: AgentProcess, url: str, credentials: dict[str, str] | None = None) -> float:
    cursor = agent.client.events()["cursor"]
    t0 = time.perf_counter()
    artifact = agent.client.download(url, credentials=credentials)["artifact_id"]
    while True:  # woken by the entry's events (no polling that would load the agent)
        page = agent.client.events(cursor, wait=30)
        cursor = page["cursor"]
        ends = [e for e in page["events"] if e.get("artifact_id") == artifact
                and e["to"] in ("ready", "failed")]
        if ends:
            break
    elapsed = time.perf_counter() - t0
    assert ends[-1]["to"] == "ready", ends
    agent.client.delete_artifact(artifact)
    return elapsed


def measure(runs: int, stage: Callable[[], float], plain: Callable[[], float]) -> tuple[
        list[float], list[float]]:
    stage_s, plain_s = [], []
    for _ in range(runs):
        plain_s.append(plain())
        stage_s.append(stage())
    return stage_s, plain_s


def run(size_mib: int, runs: int) -> Result:
    work = Path(tempfile.mkdtemp(prefix="bench-staging-"))
    weights = os.urandom(size_mib * MIB)
    hub = FakeHub().start()
    hub.add_repo("bench/model", {"config.json": b"{}", "model.safetensors": weights})
    from moto.server import ThreadedMotoServer

    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
             "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(creds)
    import boto3

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket="bench")
    s3.put_object(Bucket="bench", Key="model/model.safetensors", Body=weights,
                  ChecksumAlgorithm="SHA256")
    agent = AgentProcess(work / "state", extra_args=[
        "--weight-cache-dir", str(work / "cache"), "--artifact-reserve", "0",
        "--s3-endpoint-url", endpoint, "--log-format", "text"],
        env={"HF_ENDPOINT": hub.url, "HF_TOKEN": "", **creds})
    import hashlib

    blob = f"{hub.cdn_url}/blobs/{hashlib.sha256(weights).hexdigest()}"
    lines, figures = [], {}
    try:
        agent.start()

        def timed(fn: Callable[[], None]) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        for name, stage, plain in (
            ("hub", lambda: staged(agent, "hf://bench/model"),
             lambda: timed(lambda: plain_http(blob, work / "plain.bin"))),
            ("s3", lambda: staged(agent, "s3://bench/model"),
             lambda: timed(lambda: plain_s3(s3, "bench", "model/model.safetensors",
                                            work / "plain.bin"))),
        ):
            stage_s, plain_s = measure(runs, stage, plain)
            st, pl = statistics.median(stage_s), statistics.median(plain_s)
            figures[name] = (st, pl, st / pl)
            lines.append(f"{name}: staged {size_mib / st:.0f} MiB/s (median {st:.2f} s, runs "
                         f"{', '.join(f'{s:.2f}' for s in stage_s)}), plain copy "
                         f"{size_mib / pl:.0f} MiB/s (median {pl:.2f} s, runs "
                         f"{', '.join(f'{s:.2f}' for s in plain_s)}), ratio {st / pl:.3f}")
    finally:
        agent.cleanup()
        hub.stop()
        moto.stop()
    worst = max(r for _, _, r in figures.values())
    measured = "; ".join(f"{k} {size_mib / v[0]:.0f} vs {size_mib / v[1]:.0f} MiB/s "
                         f"(x{v[2]:.3f})" for k, v in figures.items())
    return Result("8. weight-cache staging throughput vs a plain copy",
                  f"staged time <= {GOAL:.2f} x plain copy", measured, worst <= GOAL,
                  {"figures": figures}, lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    result = run(args.size_mib, args.runs)
    print(result.report())
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
