#!/usr/bin/env python
"""Growing a featurized store by 10% more rows against featurizing every row again.

What it measures: the wall time of ``trak featurize`` (features and kernels)
and of ``trak score`` when new rows are appended to a store featurized
before, against the same commands on a new store of all the rows at once;
and that both give the same scores.

Setup: the digits MLP of ``configs/digits.yaml`` (64-128-128-10, 26,122
parameters; ``--models`` seeded untrained checkpoints: timings do not depend on
the weights), ``projector.kind: sjlt``, ``proj_dim`` 1024, ``chunk_rows`` 512,
batch 128. The train rows are scikit-learn's 1,437 digits train images repeated
with N(0, 0.05²) pixel noise to ``--n-old`` rows in ``old.pt``; the appended
rows (``--fraction`` of them, default 10%) are more such rows in a second file
``new.pt`` (``data.train.path: [old.pt, new.pt]``), so the old store's last chunk
is partly filled when ``n_old`` is not a multiple of 512 (the default 20,000 is
not). 200 targets from the digits held-out rows, full score matrix.

Timed, each in this process through the job functions the CLI calls
(:func:`trakcli.jobs.featurize.featurize`, :func:`trakcli.jobs.score.score`),
best of ``--repeats``:

- ``at once``: featurize ``[old.pt, new.pt]`` into a new store, then score;
- ``append``: with a store of ``old.pt`` featurized and scored (not timed, and
  before the ``at once`` run, so that one-off costs of the process fall on neither),
  featurize ``[old.pt, new.pt]`` (only the new rows; kernels made again from the
  stored features), then rescore (``score --overwrite``, target features kept).

Also reported: the rows featurized by the append, how many chunk files of the
old store's full chunks were rewritten (their mtime and bytes, expected 0), and
the largest relative difference of the two score matrices.

    python -m benchmarks.bench_append                 # 20,000 + 2,000 rows, 2 checkpoints
    python -m benchmarks.bench_append --quick         # 4,000 + 400 rows, 1 checkpoint

Prints a table and writes JSON (``--out``, default bench_results/append.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import torch

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic: a killed run keeps the previous result)
MLP = {"in_dim": 64, "hidden_dim": 128, "num_classes": 10, "depth": 2}  # configs/digits.yaml


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run_info(argv: list[str], threads: int) -> dict[str, Any]:
    """The command and the run's threads and load (write_result adds date, commit, version and machine)."""
    return {
        "command": " ".join(["python", "-m", "benchmarks.bench_append", *argv]),
        "machine": {"threads": threads, "load_average_1min": os.getloadavg()[0]},
    }


def make_data(root: Path, n_old: int, n_new: int, n_target: int) -> None:
    """``old.pt`` (rows 0..n_old-1), ``new.pt`` (the next n_new) and ``target.pt``: noisy digits."""
    from trakcli.data.digits import load_digits_split

    x, y, xt, yt = load_digits_split()
    g = torch.Generator().manual_seed(0)
    pick = torch.randint(0, len(y), (n_old + n_new,), generator=g)
    xs = (x[pick] + 0.05 * torch.randn(len(pick), x.shape[1], generator=g)).clamp(0, 1)
    torch.save({"x": xs[:n_old].clone(), "y": y[pick[:n_old]].clone()}, root / "old.pt")
    torch.save({"x": xs[n_old:].clone(), "y": y[pick[n_old:]].clone()}, root / "new.pt")
    torch.save({"x": xt[:n_target].clone(), "y": yt[:n_target].clone()}, root / "target.pt")


def config(root: Path, store: str, files: list[str], models: int, threads: int) -> Any:
    from trakcli.config import load_config

    return load_config({
        "model": {"entrypoint": "mlp", "kwargs": MLP},
        "checkpoints": [str(root / f"model_{i}.pt") for i in range(models)],
        "data": {
            "train": {"path": [str(root / f) for f in files], "inputs": "x", "labels": "y"},
            "target": {"path": str(root / "target.pt"), "inputs": "x", "labels": "y"},
            "batch_size": 128,
        },
        "projector": {"kind": "sjlt", "proj_dim": 1024, "seed": 0},
        "store": {"path": str(root / store), "chunk_rows": 512},
        "num_threads": threads,
    })


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def chunk_files(store: Path, below: int) -> dict[str, tuple[int, bytes]]:
    """Chunk files of the train arrays whose row chunk index is < ``below``: path -> (mtime_ns, bytes)."""
    out = {}
    for f in (store / "train").rglob("*"):
        parts = f.relative_to(store).parts
        if f.is_file() and "c" in parts and "kernel" not in parts and int(parts[parts.index("c") + 1]) < below:
            out[str(f)] = (f.stat().st_mtime_ns, f.read_bytes())
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-old", type=int, default=20_000)
    ap.add_argument("--fraction", type=float, default=0.10)
    ap.add_argument("--models", type=int, default=2)
    ap.add_argument("--targets", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4,000 + 10%% rows, 1 checkpoint, 1 repeat")
    ap.add_argument("--out", type=Path, default=REPO / "bench_results" / "append.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.n_old, args.models, args.repeats = 4_000, 1, 1
    n_new = int(round(args.n_old * args.fraction))

    from trakcli.jobs.featurize import featurize
    from trakcli.jobs.score import score
    from trakcli.models.build import make_mlp
    from trakcli.store import Store

    work = Path(tempfile.mkdtemp(prefix="bench_append_"))
    try:
        make_data(work, args.n_old, n_new, args.targets)
        for i in range(args.models):
            torch.manual_seed(i)
            torch.save(make_mlp(**MLP).state_dict(), work / f"model_{i}.pt")
        both = ["old.pt", "new.pt"]
        best: dict[str, float] = {}
        rewritten = computed = 0
        diff = 0.0
        for rep in range(args.repeats):
            for d in ("once.zarr", "grown.zarr"):
                shutil.rmtree(work / d, ignore_errors=True)
            old = config(work, "grown.zarr", ["old.pt"], args.models, args.threads)
            featurize(old)  # first, untimed: also warms up what a process does once (imports, allocations)
            score(old)
            before = chunk_files(work / "grown.zarr", args.n_old // 512)

            once = config(work, "once.zarr", both, args.models, args.threads)
            t_feat = timed(lambda: featurize(once))
            t_score = timed(lambda: score(once))
            log(f"repeat {rep}: at once: featurize {t_feat:.2f} s, score {t_score:.2f} s")

            grown = config(work, "grown.zarr", both, args.models, args.threads)
            res = {}
            t_app = timed(lambda: res.update(r=featurize(grown)))
            t_rescore = timed(lambda: score(grown, overwrite=True))
            log(f"repeat {rep}: append: featurize {t_app:.2f} s, rescore {t_rescore:.2f} s")
            after = chunk_files(work / "grown.zarr", args.n_old // 512)
            rewritten = sum(after.get(k) != v for k, v in before.items())
            computed = res["r"].chunks_computed
            for name, t in (("once_featurize", t_feat), ("once_score", t_score), ("append_featurize", t_app),
                            ("append_rescore", t_rescore)):
                best[name] = min(best.get(name, float("inf")), t)
            a = Store.open_existing(work / "once.zarr", mode="r").read("scores/default/scores")
            b = Store.open_existing(work / "grown.zarr", mode="r").read("scores/default/scores")
            diff = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = [
        ("featurize (features + kernels)", best["once_featurize"], best["append_featurize"]),
        ("score (full matrix)", best["once_score"], best["append_rescore"]),
        ("both", best["once_featurize"] + best["once_score"], best["append_featurize"] + best["append_rescore"]),
    ]
    print(f"\n{args.n_old:,} rows + {n_new:,} appended ({args.fraction:.0%}), {args.models} checkpoint(s), "
          f"proj_dim 1024, {args.targets} targets; best of {args.repeats}")
    print(f"{'step':32s} {'at once s':>10s} {'append s':>10s} {'ratio':>7s}")
    for name, a, b in rows:
        print(f"{name:32s} {a:10.2f} {b:10.2f} {b / a:7.3f}")
    print(f"append: {computed} chunk(s) featurized over {args.models} checkpoint(s); old full-chunk files rewritten: "
          f"{rewritten}; max |score difference| / max |score| = {diff:.2e}")
    out = {
        "benchmark": "append",
        **run_info(argv, args.threads),
        "setup": {"n_old": args.n_old, "n_appended": n_new, "fraction": args.fraction, "models": args.models,
                  "proj_dim": 1024, "chunk_rows": 512, "batch_size": 128, "targets": args.targets,
                  "projector": "sjlt", "model": "digits MLP 64-128-128-10", "repeats": args.repeats},
        "seconds": best,
        "append_chunks_computed": computed,
        "old_full_chunk_files_rewritten": rewritten,
        "max_rel_score_difference": diff,
    }
    write_result(args.out, out)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
