#!/usr/bin/env python
"""Scoring at scale: trakcli's streamed scoring against a plain in-memory numpy implementation.

Synthetic features (standard normal, as projected gradients are after JL) for
M checkpoints are written to a trakcli store; then, each in its own process so
that peak resident memory (ru_maxrss) is its own:

* ``trakcli``: ``trakcli.jobs.score.finalize_and_score`` — Gram matrix streamed in
  row chunks (float64), Cholesky, scores written one block of train columns at a
  time; memory O(n_target·proj_dim + chunk·proj_dim + proj_dim²).
* ``numpy``: all features in RAM, the same formula with numpy (float64 Gram and
  Cholesky solve, float32 products), the whole ``[n_target, n_train]`` matrix in RAM.

Prints a table (wall seconds, peak RSS) and writes JSON. The numpy baseline
needs about (M·n_train·proj_dim + 2·n_target·n_train)·4 bytes: 11.5 GB at the
default size, so it runs out of memory on this 24 GiB machine from roughly
n_train = 450,000 (with n_target 5000, proj_dim 2048, M 2); trakcli's peak does
not grow with n_train.

    python -m benchmarks.bench_scoring                      # n_train 200k, n_target 5k, proj_dim 2048, M 2
    python -m benchmarks.bench_scoring --quick              # a small smoke run
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)

LAMBDA_REL = 1.0


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB on Linux


def make_store(path: Path, n_train: int, n_target: int, proj_dim: int, n_models: int, chunk_rows: int) -> None:
    from trakcli.store import Store, StoreLayout

    identity = {
        "model": {"entrypoint": "synthetic"},
        "projector": {"kind": "synthetic", "proj_dim": proj_dim},
        "train_data": {"n": n_train, "input_shape": [1], "sha256": "synthetic"},
        "storage": {"chunk_rows": chunk_rows, "dtype": "float32", "compressor": "zstd"},
    }
    layout = StoreLayout(n_train, proj_dim, chunk_rows, "float32", "zstd")
    store = Store.create_or_check(path, identity, {"bench": "scoring"}, layout=layout, overwrite=True)
    t_attrs = {"target_data": {"n": n_target}, "checkpoints": list(range(n_models))}
    for m in range(n_models):
        rng = np.random.default_rng(m)
        rows = store.train(m, f"synthetic-{m}", f"{m:064d}")
        for c in range(rows.n_chunks):
            lo, hi = rows.rows(c)
            rows.write(
                c,
                features=rng.standard_normal((hi - lo, proj_dim), dtype=np.float32),
                out_to_loss=rng.uniform(0, 1, hi - lo).astype(np.float32),
                nonfinite=np.zeros(hi - lo, np.uint8),
            )
        trows = store.targets("bench", m, t_attrs, n_target)
        for c in range(trows.n_chunks):
            lo, hi = trows.rows(c)
            trows.write(c, features=rng.standard_normal((hi - lo, proj_dim), dtype=np.float32))
    store.scores("bench", n_target, {"lambda_rel": LAMBDA_REL})


def worker_trakcli(path: Path, n_models: int, n_head: int, out: Path) -> dict:
    from trakcli.jobs.plan import ScorePlan
    from trakcli.jobs.score import finalize_and_score
    from trakcli.store import Store

    t0 = time.perf_counter()
    store = Store.open_existing(path)
    train_rows = [store.train(m, create=False) for m in range(n_models)]
    n_target = store.root["targets/bench/0/features"].shape[0]
    t_attrs = {"target_data": {"n": n_target}, "checkpoints": list(range(n_models))}
    target_rows = [store.targets("bench", m, t_attrs, n_target, create=False) for m in range(n_models)]
    scores = store.scores("bench", n_target, {"lambda_rel": LAMBDA_REL}, create=False)
    finalize_and_score(store, train_rows, target_rows, scores, ScorePlan(lambda_rel=LAMBDA_REL))
    seconds = time.perf_counter() - t0
    np.save(out, np.asarray(scores.data["scores"][:n_head]))
    return {"seconds": seconds, "peak_rss_gib": _rss_gib()}


def worker_numpy(path: Path, n_models: int, n_head: int, out: Path) -> dict:
    """The formula in plain numpy with everything in memory (the baseline)."""
    import zarr

    t0 = time.perf_counter()
    root = zarr.open_group(str(path), mode="r")
    acc, q = None, None
    for m in range(n_models):
        phi = np.asarray(root[f"train/{m}/features"][:])  # [n_train, p] float32
        phi_t = np.asarray(root[f"targets/bench/{m}/features"][:])  # [n_target, p]
        qm = np.asarray(root[f"train/{m}/out_to_loss"][:]).astype(np.float64)
        phi64 = phi.astype(np.float64)
        gram = phi64.T @ phi64
        del phi64
        lam = LAMBDA_REL * np.trace(gram) / phi.shape[0]
        factor = np.linalg.cholesky(gram + lam * np.eye(gram.shape[0]))
        w = np.linalg.solve(factor.T, np.linalg.solve(factor, phi_t.T.astype(np.float64))).T.astype(np.float32)
        s = w @ phi.T  # [n_target, n_train] float32
        acc = s if acc is None else acc + s
        q = qm if q is None else q + qm
        del phi, gram, s
    scores = acc / n_models * (q / n_models).astype(np.float32)[None, :]
    seconds = time.perf_counter() - t0
    np.save(out, scores[:n_head])
    return {"seconds": seconds, "peak_rss_gib": _rss_gib()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-train", type=int, default=200_000)
    ap.add_argument("--n-target", type=int, default=5_000)
    ap.add_argument("--proj-dim", type=int, default=2048)
    ap.add_argument("--n-models", type=int, default=2)
    ap.add_argument("--chunk-rows", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="n_train 20k, n_target 500, proj_dim 512")
    ap.add_argument("--skip-numpy", action="store_true", help="only trakcli (e.g. where numpy would run out of memory)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench_results/scoring.json"))
    ap.add_argument("--worker", choices=["trakcli", "numpy"], help=argparse.SUPPRESS)
    ap.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--head-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.n_train, args.n_target, args.proj_dim = 20_000, 500, 512
    n_head = min(64, args.n_target)

    if args.worker:
        fn = worker_trakcli if args.worker == "trakcli" else worker_numpy
        print(json.dumps(fn(args.store, args.n_models, n_head, args.head_out)))
        return

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_scoring_"))
    work.mkdir(parents=True, exist_ok=True)
    store = work / "synthetic.zarr"
    print(f"writing synthetic features to {store} ...", file=sys.stderr)
    t0 = time.perf_counter()
    make_store(store, args.n_train, args.n_target, args.proj_dim, args.n_models, args.chunk_rows)
    print(f"  {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    results = {}
    for method in ("trakcli",) + (() if args.skip_numpy else ("numpy",)):
        print(f"running {method} ...", file=sys.stderr)
        head = work / f"head_{method}.npy"
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", method, "--store", str(store), "--head-out", str(head),
             "--n-models", str(args.n_models), "--n-target", str(args.n_target)],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            results[method] = {"error": (proc.stderr.strip().splitlines() or ["killed (out of memory?)"])[-1],
                               "returncode": proc.returncode}
            continue
        results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
        results[method]["head"] = str(head)
    if "numpy" in results and "seconds" in results.get("numpy", {}) and "seconds" in results["trakcli"]:
        a, b = np.load(results["trakcli"]["head"]), np.load(results["numpy"]["head"])
        results["max_rel_diff_first_targets"] = float(np.abs(a - b).max() / np.abs(b).max())
        results["time_ratio_trakcli_over_numpy"] = results["trakcli"]["seconds"] / results["numpy"]["seconds"]

    sizes = {k: getattr(args, k) for k in ("n_train", "n_target", "proj_dim", "n_models", "chunk_rows")}
    print(f"\nscoring benchmark: {sizes}")
    print(f"{'method':<10} {'seconds':>10} {'peak RSS GiB':>14}")
    for method in ("trakcli", "numpy"):
        r = results.get(method)
        if r is None:
            continue
        if "error" in r:
            print(f"{method:<10} {'failed':>10} {r['error']}")
        else:
            print(f"{method:<10} {r['seconds']:>10.1f} {r['peak_rss_gib']:>14.2f}")
    if "time_ratio_trakcli_over_numpy" in results:
        print(f"time trakcli / numpy: {results['time_ratio_trakcli_over_numpy']:.2f}; "
              f"max relative difference of the first {n_head} targets' scores: {results['max_rel_diff_first_targets']:.1e}")
    write_result(args.out, {"benchmark": "bench_scoring", "sizes": sizes, "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
