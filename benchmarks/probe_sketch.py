#!/usr/bin/env python
"""Would a low-dimensional sketch of the train features find the top-k candidates? A probe on a scored store.

Reads a store's train features, out-to-loss, kernel and an experiment's target features
(checkpoint 0) into RAM, computes the exact TRAK scores ``(W Φᵀ) ⊙ Q`` and their top-k,
and for each sketch dimension r scores the targets against int8 codes (per-row scale) of
r-dimensional sketches of the rows, ``(W M) (Φ M)ᵀ ⊙ Q``, with ``M`` [proj_dim, r]:

* ``random``: orthonormal columns (QR of a seeded Gaussian), a fixed random rotation;
* ``pca``: the top-r eigenvectors of ``ΦᵀΦ`` (data-dependent, needs a pass over the rows).

It reports the recall@k of the exact top-k among the top K' of each sketch (proponents,
opponents). Everything is in RAM: use it on stores of up to a few 10^5 rows.

Usage (the store of ``benchmarks/bench_topk.py``, kept, whose experiment ``topk`` holds the target features)::

    python -m benchmarks.bench_topk --n-train 200000 --dtypes --skip faiss full --keep --out /tmp/topk.json
    python -m benchmarks.probe_sketch bench_results/topk_work/n200000/store.zarr --out bench_results/sketch_probe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.benchjson import write_result  # noqa: E402  (atomic; adds date, commit, version, machine)


def recall(exact: "torch.Tensor", approx: "torch.Tensor", k_prime: int, largest: bool) -> float:  # noqa: F821
    import torch

    got = torch.topk(approx, k_prime, dim=1, largest=largest).indices
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) / exact.shape[1] for a, b in zip(exact, got)]))


def probe(store: Path, experiment: str, k: int, dims: list[int], k_primes: list[int], seed: int) -> dict:
    import torch
    import zarr

    from trakcli.scoring import target_weights

    root = zarr.open_group(str(store), mode="r")
    phi = torch.from_numpy(np.asarray(root["train/0/features"][:], dtype=np.float32))
    q = torch.from_numpy(np.asarray(root["train/0/out_to_loss"][:], dtype=np.float32))
    phi_t = torch.from_numpy(np.asarray(root[f"targets/{experiment}/0/features"][:], dtype=np.float32))
    w = target_weights(torch.from_numpy(np.asarray(root["train/0/kernel"][:])), phi_t, dtype=torch.float32)
    scores = (w @ phi.T).mul_(q)
    exact = {True: torch.topk(scores, k, dim=1).indices, False: torch.topk(scores, k, dim=1, largest=False).indices}
    del scores
    d = phi.shape[1]
    eigvals, eigvecs = torch.linalg.eigh(phi.T.double() @ phi.double())
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in dims:
        bases = {"random": torch.linalg.qr(torch.randn(d, r, generator=g))[0],
                 "pca": eigvecs[:, -r:].float()}
        for name, m in bases.items():
            y = phi @ m
            scale = y.abs().amax(1) / 127
            codes = torch.round(y / torch.where(scale > 0, scale, 1)[:, None]).clamp_(-127, 127)
            approx = ((w @ m) @ (codes * scale[:, None]).T).mul_(q)
            for kp in k_primes:
                got = [recall(exact[True], approx, kp, True), recall(exact[False], approx, kp, False)]
                rows.append({"sketch": name, "r": r, "k_prime": kp, "recall": got})
                print(f"{name:>7} r={r:<4} K'={kp:<5} recall@{k} pro {rows[-1]['recall'][0]:.4f} "
                      f"opp {rows[-1]['recall'][1]:.4f}", flush=True)
            del approx
    energy = {r: float(eigvals.flip(0)[:r].sum() / eigvals.sum()) for r in dims}
    return {"n_train": phi.shape[0], "n_target": w.shape[0], "proj_dim": d, "k": k,
            "pca_energy": energy, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("store", type=Path)
    p.add_argument("--experiment", default="topk")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--k-primes", type=int, nargs="+", default=[200, 400, 1000])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    res = probe(a.store, a.experiment, a.k, a.dims, a.k_primes, a.seed)
    if a.out:
        write_result(a.out, {
            "benchmark": "probe_sketch",
            "args": {k: getattr(a, k) for k in ("experiment", "k", "dims", "k_primes", "seed")},
            "result": res,
        })
        print(f"-> {a.out}")


if __name__ == "__main__":
    main()
